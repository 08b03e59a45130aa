#!/usr/bin/env bash
# server_hardening.sh EXL_BINARY SHARED_DIR - CTest entry for tests/server/test_hardening.py: `exl serve`
# against slow, hostile and leaving clients, over loopback. Python's standard library only.
set -euo pipefail
exl=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
here=$(cd "$(dirname "$0")" && pwd)
exec "${EXL_TEST_PYTHON:-python3}" "$here/server/test_hardening.py" "$exl" "$2"
