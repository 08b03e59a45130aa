#!/usr/bin/env bash
# check-docs.sh - the newcomer's page stays one: README.md at most 130 lines (issue 27), and every src/ folder named
# in docs/architecture.md.
set -euo pipefail
cd "$(dirname "$0")/.."
fail=0
lines=$(wc -l <README.md)
if [ "$lines" -gt 130 ]; then
    echo "check-docs: README.md has $lines lines (at most 130: move details to docs/)" >&2
    fail=1
fi
for d in $(find src -mindepth 1 -type d | sort); do
    if ! grep -q "${d#src/}" docs/architecture.md; then
        echo "check-docs: docs/architecture.md does not name $d" >&2
        fail=1
    fi
done
[ $fail -eq 0 ] && echo "check-docs: README.md $lines lines, every src/ folder in docs/architecture.md"
exit $fail
