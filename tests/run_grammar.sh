#!/usr/bin/env bash
# run_grammar.sh EXL_BINARY SHARED_DIR - CTest entry: `exl run --grammar` with two answers from
# yes / no / maybe only ever prints such a pair, over several seeds and two models, and the
# other constraint options refuse what they cannot compile.
set -euo pipefail
exl=$1
shared=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
cat >"$dir/answers.gbnf" <<'GBNF'
root ::= answer " " answer
answer ::= "yes" | "no" | "maybe"
GBNF
fail=0
for model in tinystories-656k rand-llama; do
    for seed in 1 2 3 4 5 6 7 8; do
        out=$("$exl" run -m "$shared/models/$model" -p "Once upon a time" --grammar "$dir/answers.gbnf" \
            --seed "$seed" --temperature 1.5 -n 32 -t 1)
        if ! [[ "$out" =~ ^(yes|no|maybe)\ (yes|no|maybe)$ ]]; then
            echo "run_grammar: $model seed $seed printed '$out'" >&2
            fail=1
        fi
    done
done
# errors name what is wrong
echo 'root ::= undefined-rule' >"$dir/bad.gbnf"
if err=$("$exl" run -m "$shared/models/tinystories-656k" -p x --grammar "$dir/bad.gbnf" 2>&1); then
    echo "run_grammar: a bad grammar was accepted" >&2
    fail=1
elif [[ "$err" != *"'undefined-rule' is used but not defined"* ]]; then
    echo "run_grammar: unclear error: $err" >&2
    fail=1
fi
echo '{"type": "string", "format": "email"}' >"$dir/schema.json"
if err=$("$exl" run -m "$shared/models/tinystories-656k" -p x --json-schema "$dir/schema.json" 2>&1) ||
    [[ "$err" != *"'format' is not supported"* ]]; then
    echo "run_grammar: unsupported schema keyword not named: $err" >&2
    fail=1
fi
out=$("$exl" run -m "$shared/models/tinystories-656k" -p "Call" --regex '\d{3}-\d{4}' --seed 9 -n 32 -t 1)
if ! [[ "$out" =~ ^[0-9]{3}-[0-9]{4}$ ]]; then
    echo "run_grammar: --regex printed '$out'" >&2
    fail=1
fi
[ $fail = 0 ] && echo "run_grammar: ok"
exit $fail
