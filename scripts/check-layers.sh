#!/usr/bin/env bash
# check-layers.sh - every `#include "dir/..."` between src/ folders must follow the layer table below, and the
# table itself must have no cycle, so the folders' dependencies point down only:
#
#   cli -> server -> generator -> convert -> model -> (backend/cpu, backend/cuda) -> backend -> format -> io -> base
#   tokenizer -> jinja -> base
#   constrain -> base   (generator, server and cli may include it)
#
# model/ and the folders above it never include a particular backend (backend/cpu, backend/cuda): they reach it
# through the op table (docs/architecture.md).
#
# A folder is the directory of a file under src/ (backend/cpu is a folder of its own, apart from backend); an
# include names the folder of its path ("backend/cpu/kernels.h": backend/cpu). Includes without a folder
# ("exl.h", a file beside the includer) are not checked. A folder may include its own headers and those of the
# folders listed for it; a folder missing from the table is an error (add it). Exit 1 on any violation.
#
#   scripts/check-layers.sh [ROOT]     (ROOT: the project root, default: this script's parent)
set -euo pipefail

root=${1:-$(cd "$(dirname "$0")/.." && pwd)}

# folder: the folders it may include (besides itself)
declare -A allowed=(
    [base]=""
    [io]="base"
    [format]="io base"
    [backend]="format io base"
    [backend/cpu]="backend format io base"
    [backend/cuda]="backend format io base"
    [model]="backend format io base"
    [convert]="model backend format io base"
    [generator]="convert model backend format io base tokenizer jinja constrain"
    [constrain]="base"
    [jinja]="base"
    [tokenizer]="jinja io base"
    [server]="generator convert model backend format io base tokenizer jinja constrain"
    [cli]="server generator convert model backend format io base tokenizer jinja constrain"
)

fail=0

# the table has no cycle: a depth-first walk from every folder never comes back to a folder on its path
declare -A state=() # 1: on the current path, 2: done
visit() {
    local dir=$1 dep
    state[$dir]=1
    for dep in ${allowed[$dir]-}; do
        if [[ -z ${allowed[$dep]+set} ]]; then
            echo "check-layers: table: $dir may include $dep, which has no entry" >&2
            fail=1
        elif [[ ${state[$dep]-} == 1 ]]; then
            echo "check-layers: table: cycle through $dir -> $dep" >&2
            fail=1
        elif [[ -z ${state[$dep]-} ]]; then
            visit "$dep"
        fi
    done
    state[$dir]=2
}
for dir in "${!allowed[@]}"; do
    [[ -n ${state[$dir]-} ]] || visit "$dir"
done

# every include between folders is allowed
n_files=0
while IFS= read -r -d '' file; do
    n_files=$((n_files + 1))
    rel=${file#"$root"/src/}
    from=$(dirname "$rel")
    if [[ -z ${allowed[$from]+set} ]]; then
        echo "check-layers: src/$rel: folder $from is not in the layer table (scripts/check-layers.sh)" >&2
        fail=1
        continue
    fi
    while IFS= read -r line; do
        lineno=${line%%:*}
        path=$(sed -E 's/^[0-9]+:[[:space:]]*#[[:space:]]*include[[:space:]]*"([^"]*)".*/\1/' <<<"$line")
        [[ $path == */* ]] || continue
        to=$(dirname "$path")
        [[ $to == "$from" ]] && continue
        if [[ " ${allowed[$from]} " != *" $to "* ]]; then
            echo "check-layers: src/$rel:$lineno: $from must not include $path ($from may include: ${allowed[$from]:-nothing})" >&2
            fail=1
        fi
    done < <(grep -nE '^[[:space:]]*#[[:space:]]*include[[:space:]]*"' "$file" || true)
done < <(find "$root/src" -type f \( -name '*.c' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' \) -print0)

if ((n_files == 0)); then
    echo "check-layers: no sources under $root/src" >&2
    exit 1
fi
if ((fail)); then
    exit 1
fi
echo "check-layers: $n_files files follow the layer table"
