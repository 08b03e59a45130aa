#!/usr/bin/env bash
# server_kv_cache.sh EXL_BINARY SHARED_DIR - CTest entry for tests/server/test_kv_cache.py: `exl serve` with a
# 1024-token 4-bit KV cache answers 32 concurrent 100-token requests (standard-library Python only).
set -euo pipefail
exl=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
here=$(cd "$(dirname "$0")" && pwd)
exec "${EXL_TEST_PYTHON:-python3}" "$here/server/test_kv_cache.py" "$exl" "$2"
