#!/usr/bin/env bash
# server_speculative.sh EXL_BINARY SHARED_DIR - CTest entry for tests/server/test_speculative.py: `exl serve` with
# n-gram and draft-model drafting gives what plain decoding gives, per request opt-out, metrics (standard-library
# Python only).
set -euo pipefail
exl=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
here=$(cd "$(dirname "$0")" && pwd)
exec "${EXL_TEST_PYTHON:-python3}" "$here/server/test_speculative.py" "$exl" "$2"
