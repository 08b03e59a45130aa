#!/usr/bin/env bash
# server_web_chat.sh EXL_BINARY SHARED_DIR [SCREENSHOT.png] - CTest entry for tests/server/test_web_chat.py: the web
# chat of `exl serve` driven in headless Chromium over the DevTools protocol. Chromium is part of the setup (Debian
# package `chromium`, installed by .ci/run); without it the test fails. docs/web-chat.png is its screenshot
# (bash tests/server_web_chat.sh build/exl ../shared docs/web-chat.png).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
exec python3 "$here/server/test_web_chat.py" "$@"
