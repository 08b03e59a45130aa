#!/usr/bin/env bash
# server_structured.sh EXL_BINARY SHARED_DIR - CTest entry for tests/server/test_structured.py:
# structured output (response_format) and tool calling of the server, driven by the official
# `openai` Python package, which is part of the setup (see tests/server_openai.sh; the Python that
# has it may be named by EXL_TEST_PYTHON). Without it the test fails.
set -euo pipefail
exl=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
shared=$2
here=$(cd "$(dirname "$0")" && pwd)
py=${EXL_TEST_PYTHON:-python3}
if ! "$py" -c 'import openai' 2>/dev/null; then
    echo "server_structured: FAILED, not run: $py cannot import the 'openai' package (see tests/server_openai.sh)" >&2
    exit 1
fi
export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}quarantine_size_mb=4"
exec "$py" "$here/server/test_structured.py" "$exl" "$shared"
