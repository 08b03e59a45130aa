#!/bin/bash
# prepare.sh - fill .gpu/ (git-ignored) for a GPU machine that cannot see ../shared and may
# lack the build dependencies: the fixtures it tests against (shared/: config, weights and
# reference logits of every model, about 58 MB; the tokenizers of rand-llama, rand-phi3 and rand-qwen3moe and a
# calibration text for the quantizer test) and, built here, the GPU programs (bin/).
#
# usage (here, from the repo root): tests/gpu/prepare.sh [SHARED_DIR] [CUDA_ARCHS]
# then on the GPU machine: tests/gpu/run.sh   (carry .gpu/bin and .gpu/fixtures-N.tar.gz)
set -euo pipefail
shared=${1:-../shared}
archs=${2:-90}
rm -rf .gpu/shared .gpu/bin
mkdir -p .gpu/shared/models .gpu/shared/reference .gpu/bin
for d in "$shared"/models/*/; do
    n=$(basename "$d")
    [ -f "$shared/reference/$n.logits.safetensors" ] || continue
    mkdir -p ".gpu/shared/models/$n"
    cp "$d"config.json "$d"*.safetensors ".gpu/shared/models/$n/"
    [ -f "$d"quantize_config.json ] && cp "$d"quantize_config.json ".gpu/shared/models/$n/"
    cp "$shared/reference/$n.logits.safetensors" .gpu/shared/reference/
done
# the LoRA tests: PEFT's adapters for rand-llama and their reference logits (one file for both)
for n in rand-llama-lora-a1 rand-llama-lora-a2; do
    mkdir -p ".gpu/shared/models/$n"
    cp "$shared/models/$n/adapter_config.json" "$shared/models/$n/adapter_model.safetensors" ".gpu/shared/models/$n/"
done
cp "$shared/reference/rand-llama-lora.logits.safetensors" .gpu/shared/reference/
# the quantizer test: the tokenizers of the models it quantizes and the first 64 kB (whole lines) of a calibration
# text; the prompt path's perplexity (bench/gpu_prefill_ppl.sh): its models' tokenizers and the first 200 kB of
# TinyStories
for m in rand-llama rand-phi3 rand-qwen3moe tinystories-656k tinystories-656k-gptq-4bit-g32-actorder-asym \
    rand-llama-exl2-5.0bpw-h8; do
    for f in tokenizer.json tokenizer_config.json special_tokens_map.json; do
        cp "$shared/models/$m/$f" ".gpu/shared/models/$m/"
    done
done
mkdir -p .gpu/shared/data/calibration
head -c 65536 "$shared/data/calibration/tiny.utf8" | sed '$d' >.gpu/shared/data/calibration/tiny.utf8
head -c 200000 "$shared/data/tinystories_val.txt" | sed '$d' >.gpu/shared/data/tinystories_val.txt
cmake -S . -B build-gpu -DEXL_CUDA=ON -DEXL_CUDA_ARCHS="$archs" >/dev/null
cmake --build build-gpu -j"$(nproc)" --target test_gpu gpu_bench gpu_lora_bench exl_cuda exl-cli >/dev/null
for f in test_gpu gpu_bench gpu_lora_bench exl libexl_cuda.so; do strip -o ".gpu/bin/$f" "build-gpu/$f"; done
# run-time libraries of the core that a bare CUDA image may not have
for lib in $(ldd build-gpu/test_gpu build-gpu/gpu_bench build-gpu/gpu_lora_bench build-gpu/exl |
    awk '/=> \// {print $3}' | sort -u); do
    case $(basename "$lib") in
    libc.so* | libm.so* | libdl.so* | librt.so* | libpthread.so* | libgcc_s.so* | libstdc++.so* | libcublas*) ;;
    *) cp -L "$lib" .gpu/bin/ ;;
    esac
done
# the fixtures packed in parts of at most ~40 MB (random weights hardly compress): a device call carries 64 MiB,
# so a run may need two calls, the first carrying .gpu/bin and part 1 and staging it (run.sh --stage), the next
# the other part; run.sh unpacks every part it is given into its staging folder, which lasts while the machine does
rm -f .gpu/fixtures-*.tar.gz
part=1 size=0 list=()
pack() { [ ${#list[@]} -gt 0 ] && tar czf ".gpu/fixtures-$part.tar.gz" -C .gpu "${list[@]}"; part=$((part + 1)) size=0 list=(); }
for d in .gpu/shared/models/*/; do
    n=$(basename "$d")
    ref=shared/reference/$n.logits.safetensors
    [ -f ".gpu/$ref" ] || ref= # the LoRA adapters' reference goes with shared/data
    bytes=$(du -sb "$d" ${ref:+".gpu/$ref"} | awk '{s += $1} END {print s}')
    [ $((size + bytes)) -gt 40000000 ] && pack
    list+=("shared/models/$n" ${ref:+"$ref"})
    size=$((size + bytes))
done
list+=(shared/data shared/reference/rand-llama-lora.logits.safetensors)
pack
du -sh .gpu/bin .gpu/shared .gpu/fixtures-*.tar.gz
