#!/usr/bin/env bash
# server_openai.sh EXL_BINARY SHARED_DIR - CTest entry for tests/server/test_openai.py: the
# OpenAI-compatible server driven by the official `openai` Python package. The package is
# part of the setup, never installed here (.ci/run installs it):
#     python3 -m pip install openai    (add --break-system-packages where pip refuses, PEP 668)
# or, in a venv:
#     python3 -m venv VENV && VENV/bin/pip install openai, then run the tests with
#     EXL_TEST_PYTHON=VENV/bin/python
# Without it the test fails (a skipped test must not pass for a tested one).
set -euo pipefail
exl=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
shared=$2
here=$(cd "$(dirname "$0")" && pwd)
py=${EXL_TEST_PYTHON:-python3}
if ! "$py" -c 'import openai' 2>/dev/null; then
    echo "server_openai: FAILED, not run: $py cannot import the 'openai' package. It is part of the setup:" >&2
    echo "    $py -m pip install openai    (or with --break-system-packages, or in a venv named by" >&2
    echo "    EXL_TEST_PYTHON=/path/to/venv/bin/python); .ci/run installs it" >&2
    exit 1
fi
# under ASan, a small quarantine keeps the memory check about the server, not the sanitizer
export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}quarantine_size_mb=4"
exec "$py" "$here/server/test_openai.py" "$exl" "$shared"
