#!/usr/bin/env bash
# gpu_speculative.sh - speculative decoding on the GPU: a random 7B EXL2 4.0 bpw target (Llama-2-7B shape, written by
# make_random_quant) decoding 256 greedy tokens alone, tok/s against plain decoding:
#   self   the model drafting for itself (a second copy) at K = 1..8 (acceptance 1.0, the draft as dear as the model);
#   alpha  a small random draft of the same vocabulary (hidden 1024, 4 layers) whose proposals are replaced to agree
#          with the model's output with probability alpha = 0.5 .. 1.0, at K = 2, 4, 8 (--draft-fixed) and adaptive
#          K <= 8; the test-only hook EXL_SPEC_TEST_ORACLE / EXL_SPEC_TEST_ALPHA (src/generator/draft_oracle.c) takes
#          the plain run's tokens as the agreeing ones;
#   ngram  n-gram drafting (--ngram 3) on a prompt that asks to repeat a long passage, K = 4 and 8.
# Every run also says whether its tokens are the plain run's. The log goes to $OUT/spec.log, the table for
# bench/RESULTS.md to $OUT/spec_table.md.
#
# Preparing here (a CUDA build; binaries, libraries and the llama2 tokenizer go to .gpuspec/, git-ignored):
#   bench/gpu_speculative.sh --prepare
# On the GPU machine (carry .gpuspec): bench/gpu_speculative.sh [plain self alpha ngram]   (default: all four;
# plain must come first on a fresh machine: it writes the models and the plain run's tokens)
set -uo pipefail
if [ "${1:-}" = --prepare ]; then
    set -e
    cmake -S . -B build-gpu -DEXL_CUDA=ON -DEXL_CUDA_ARCHS="${EXL_CUDA_ARCHS:-90}" >/dev/null
    cmake --build build-gpu -j"$(nproc)" --target exl-cli make_random_quant exl_cuda >/dev/null
    rm -rf .gpuspec && mkdir -p .gpuspec/bin .gpuspec/tok
    for f in exl make_random_quant libexl_cuda.so; do strip -o ".gpuspec/bin/$f" "build-gpu/$f"; done
    for lib in $(ldd build-gpu/exl build-gpu/make_random_quant | awk '/=> \// {print $3}' | sort -u); do
        case $(basename "$lib") in
        libc.so* | libm.so* | libdl.so* | librt.so* | libpthread.so* | libgcc_s.so* | libstdc++.so* | libcublas*) ;;
        *) cp -L "$lib" .gpuspec/bin/ ;;
        esac
    done
    cp ../shared/tokenizers/llama2-hf/{tokenizer.json,tokenizer_config.json,special_tokens_map.json} .gpuspec/tok/
    du -sh .gpuspec
    exit 0
fi
bin=${BIN:-.gpuspec/bin}
out=${OUT:-.gpuspec/out}
mkdir -p "$out"
export LD_LIBRARY_PATH=$PWD/$bin:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
m=${MODEL:-/tmp/m7b-exl2-4.0}   # MODEL, DRAFT, DEVICE, N: other models, device, length (a smoke test on the CPU)
d=${DRAFT:-/tmp/draft-exl2-4.0}
device=${DEVICE:-cuda}
N=${N:-256}
log=$out/spec.log
table=$out/spec_table.md
phases=${*:-plain self alpha ngram}
PROMPT="The history of the city begins with a small settlement on the river, where traders met to exchange grain,
salt and cloth. Over the centuries it grew into a market town, then a regional capital with"
PASSAGE="The old lighthouse stood at the end of the pier, its white paint peeling in the salt wind. Every evening the
keeper climbed the one hundred and twelve steps to light the lamp, and every morning he climbed them again to put it
out. Ships passed in the night and never knew his name, but they knew his light, and that was enough for him."
REPEAT="Repeat the following passage exactly, word for word, three times.

$PASSAGE

Repeated three times:
$PASSAGE
"

# tok/s of one run of exl run (arguments), its tokens in $out/tokens_<tag>.txt, its drafts' acceptance in $acc
run() {
    local tag=$1
    shift
    local r
    r=$(timeout 300 "$bin/exl" run --device "$device" --greedy --ignore-eos -n $N --json --stats "$@" 2>&1)
    echo "== $tag: $*" >>"$log"
    echo "$r" | tail -3 >>"$log"
    sed -n 's/.*"tokens":\[\([0-9,]*\)\].*/\1/p' <<<"$r" >"$out/tokens_$tag.txt"
    acc=$(sed -n 's/.*acceptance rate \([0-9.]*\)%.*/\1/p' <<<"$r")
    tps=$(sed -n 's/.*tokens generated in .* (\([0-9.]*\) tokens\/s).*/\1/p' <<<"$r")
}
same() { cmp -s "$out/tokens_$1.txt" "$out/tokens_$2.txt" && echo yes || echo NO; }
speedup() { awk -v a="$1" -v b="$2" 'BEGIN { if (a > 0 && b > 0) printf "%.2fx", a / b; else print "-" }'; }

[ "$device" = cpu ] || nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$log"
for phase in $phases; do
    case $phase in
    plain)
        [ -f "$m/config.json" ] || "$bin/make_random_quant" -o "$m" --format exl2 --hidden 4096 --layers 32 \
            --heads 32 --kv-heads 32 --ffn 11008 --vocab 32000 --tokenizer-from .gpuspec/tok >>"$log" 2>&1
        [ -f "$d/config.json" ] || "$bin/make_random_quant" -o "$d" --format exl2 --hidden 1024 --layers 4 \
            --heads 16 --kv-heads 16 --ffn 2816 --vocab 32000 --seed 7 --tokenizer-from .gpuspec/tok >>"$log" 2>&1
        run plain -m "$m" -p "$PROMPT"
        echo "$tps" >"$out/plain_tps.txt"
        run plain_repeat -m "$m" -p "$REPEAT"
        echo "$tps" >"$out/plain_repeat_tps.txt"
        run draft_alone -m "$d" -p "$PROMPT"
        {
            echo "| run | K | acceptance | tok/s | vs plain | tokens = plain's |"
            echo "|---|---|---|---|---|---|"
            echo "| plain decoding | - | - | $(cat "$out/plain_tps.txt") | 1.00x | - |"
            echo "| the random draft alone (hidden 1024, 4 layers) | - | - | $tps | - | - |"
        } >"$table"
        ;;
    self)
        base=$(cat "$out/plain_tps.txt")
        for k in 1 2 3 4 5 6 7 8; do
            run self_$k -m "$m" -p "$PROMPT" --draft-model "$m" --draft-tokens $k --draft-fixed
            echo "| self-draft | $k | ${acc}% | $tps | $(speedup "$tps" "$base") | $(same self_$k plain) |" >>"$table"
        done
        ;;
    alpha)
        base=$(cat "$out/plain_tps.txt")
        export EXL_SPEC_TEST_ORACLE=$out/tokens_plain.txt
        for a in 0.5 0.7 0.8 0.9 1.0; do
            export EXL_SPEC_TEST_ALPHA=$a
            for k in 2 4 8; do
                run alpha_${a}_$k -m "$m" -p "$PROMPT" --draft-model "$d" --draft-tokens $k --draft-fixed
                echo "| random draft, alpha $a | $k | ${acc}% | $tps | $(speedup "$tps" "$base") |" \
                    "$(same alpha_${a}_$k plain) |" >>"$table"
            done
            run alpha_${a}_adaptive -m "$m" -p "$PROMPT" --draft-model "$d" --draft-tokens 8
            echo "| random draft, alpha $a | adaptive <= 8 | ${acc}% | $tps | $(speedup "$tps" "$base") |" \
                "$(same alpha_${a}_adaptive plain) |" >>"$table"
        done
        unset EXL_SPEC_TEST_ORACLE EXL_SPEC_TEST_ALPHA
        ;;
    ngram)
        base=$(cat "$out/plain_repeat_tps.txt")
        echo "| plain decoding, repeat-the-passage prompt | - | - | $base | 1.00x | - |" >>"$table"
        for k in 4 8; do
            run ngram_$k -m "$m" -p "$REPEAT" --ngram 3 --draft-tokens $k
            echo "| n-gram 3, repeat-the-passage prompt | adaptive <= $k | ${acc}% | $tps | $(speedup "$tps" "$base") |" \
                "$(same ngram_$k plain_repeat) |" >>"$table"
        done
        ;;
    esac
done
cat "$table"
