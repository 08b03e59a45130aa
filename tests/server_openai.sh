#!/usr/bin/env bash
# server_openai.sh EXL_BINARY SHARED_DIR - CTest entry for tests/server/test_openai.py: the
# OpenAI-compatible server driven by the official `openai` Python package, installed
# here with pip when missing (into a venv under the build directory if pip refuses to
# touch the system Python). Needs python3 with pip or venv (Debian: python3-pip, python3-venv).
set -euo pipefail
exl=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
shared=$2
here=$(cd "$(dirname "$0")" && pwd)
py=python3
if ! "$py" -c 'import openai' 2>/dev/null; then
    if ! "$py" -m pip install --quiet --disable-pip-version-check openai 2>/dev/null &&
        ! "$py" -m pip install --quiet --disable-pip-version-check --break-system-packages openai 2>/dev/null; then
        venv=$(dirname "$exl")/openai-venv
        [ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
        "$venv/bin/python" -m pip install --quiet --disable-pip-version-check openai
        py=$venv/bin/python
    fi
fi
# under ASan, a small quarantine keeps the memory check about the server, not the sanitizer
export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}quarantine_size_mb=4"
exec "$py" "$here/server/test_openai.py" "$exl" "$shared"
