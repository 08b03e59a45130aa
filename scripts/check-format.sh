#!/usr/bin/env bash
# check-format.sh - list the C and CUDA sources that clang-format (with .clang-format) would change; changes
# nothing. Exit status 0 when every file is formatted, 1 when some differ, 2 without clang-format.
# usage: scripts/check-format.sh [--diff] [FILE...]   (default: every tracked .c .h .cu .cuh file)
set -euo pipefail
cd "$(dirname "$0")/.."
show_diff=0
if [ "${1:-}" = "--diff" ]; then
    show_diff=1
    shift
fi
format=${CLANG_FORMAT:-clang-format}
if ! command -v "$format" >/dev/null; then
    echo "check-format.sh: $format not found (Debian: apt-get install clang-format; or set CLANG_FORMAT)" >&2
    exit 2
fi
if [ $# -eq 0 ]; then
    mapfile -t files < <(git ls-files '*.c' '*.h' '*.cu' '*.cuh')
else
    files=("$@")
fi
differ=0
changed_lines=0
for f in "${files[@]}"; do
    if ! out=$(diff -u "$f" <("$format" --style=file "$f")); then
        differ=$((differ + 1))
        changed_lines=$((changed_lines + $(grep -c '^-' <<<"$out") - 1)) # less the "--- file" header
        echo "$f"
        [ $show_diff -eq 1 ] && printf '%s\n' "$out"
    fi
done
if [ $differ -gt 0 ]; then
    echo "check-format.sh: $differ of ${#files[@]} files differ from .clang-format ($changed_lines lines would change)" >&2
    exit 1
fi
echo "check-format.sh: ${#files[@]} files formatted" >&2
