#!/usr/bin/env bash
# server_lora.sh EXL_BINARY SHARED_DIR - CTest entry for tests/server/test_lora.py: `exl serve --lora-modules`
# answers concurrent greedy requests for the base and two adapters as `exl run --lora` does (standard-library Python).
set -euo pipefail
exl=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
here=$(cd "$(dirname "$0")" && pwd)
exec "${EXL_TEST_PYTHON:-python3}" "$here/server/test_lora.py" "$exl" "$2"
