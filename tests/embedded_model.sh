#!/usr/bin/env bash
# embedded_model.sh EXL_BINARY SHARED_DIR - the model committed in models/tinystories-656k is what exl runs when -m
# is left out: `exl run -p "Once upon a time" -n 16` works with no model named, `--help` names the embedded
# directory as the default, and its greedy text is the reference greedy text of tinystories-656k (from SHARED_DIR).
set -euo pipefail
exl=$1
shared=$2
root=$(cd "$(dirname "$0")/.." && pwd)
fail() {
    echo "embedded_model: FAILED: $*" >&2
    exit 1
}

out=$("$exl" run -p "Once upon a time" -n 16 -t 1) || fail "exl run without -m exited $?"
[ -n "$out" ] || fail "exl run without -m printed nothing"

# the help text is taken whole first: grep -q stops reading at its match, and under pipefail the writer's SIGPIPE
# would fail the pipeline
help=$("$exl" run --help)
grep -q "default $root/models/tinystories-656k" <<<"$help" ||
    fail "exl run --help does not name $root/models/tinystories-656k as the default model"

want=$(python3 -c 'import json, sys
for p in json.load(open(sys.argv[1]))["prompts"]:
    if p["prompt"] == "Once upon a time":
        print(p["greedy_text"])' "$shared/reference/tinystories-656k.json")
got="Once upon a time$("$exl" run -p "Once upon a time" -n 48 --greedy -t 1)"
# exl run ends with a newline after the completion; the reference has none
[ "$got" = "$want" ] || fail "greedy text differs from the reference:
  got:  $got
  want: $want"
echo "embedded_model: 3 passed, 0 failed"
