#!/usr/bin/env bash
# fuzz-seed.sh CORPUS_DIR SHARED_DIR - give every libFuzzer target a corpus directory CORPUS_DIR/NAME
# (NAME: tests/fuzz/fuzz_NAME.c) and seed it: tests/fuzz/corpus/NAME, the shared models' config.json
# files (config), the shared tokenizers' chat templates (jinja) and tinystories' tokenizer.json
# (tokenizer). Files already there are kept, so a corpus grows from run to run.
set -euo pipefail
cd "$(dirname "$0")/.."
corpus=$1
shared=$2
for src in tests/fuzz/fuzz_*.c; do
    name=$(basename "$src" .c | sed 's/^fuzz_//')
    mkdir -p "$corpus/$name"
    if [ -d "tests/fuzz/corpus/$name" ]; then
        cp -n tests/fuzz/corpus/"$name"/* "$corpus/$name/"
    fi
done
for m in "$shared"/models/*/; do
    [ -f "$m/config.json" ] && cp -n "$m/config.json" "$corpus/config/$(basename "$m").json"
done
for t in "$shared"/tokenizers/*/; do
    out="$corpus/jinja/$(basename "$t").jinja"
    [ -f "$t/tokenizer_config.json" ] && [ ! -e "$out" ] && python3 -c 'import json,sys; t=json.load(open(sys.argv[1])).get("chat_template"); t and open(sys.argv[2],"w").write(t if isinstance(t,str) else t[0]["template"])' \
        "$t/tokenizer_config.json" "$out"
done
cp -n "$shared/models/tinystories-656k/tokenizer.json" "$corpus/tokenizer/tinystories.json"
exit 0
