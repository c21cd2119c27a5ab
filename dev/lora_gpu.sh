#!/usr/bin/env bash
# Long-context LoRA of Llama-3.1-8B's shape on the GPU machine in one device call: the transformers GPU tests of
# apply under PEFT, the ladder at LADDER against HF + SDPA + checkpointing (every provider, 2 steps after 1 warm-up),
# and one whole step (first step: compiles included) at each length of LONG with the offload + MLP-chunks provider.
# A 128K step takes about a minute, a 256K one about three, a 384K one more than nine (the call's limit is ten).
# Results: $OUT/lora/ (the benchmark's .md and .json) and $OUT/*.log.
#
#   OUT=out bash dev/lora_gpu.sh                                   # LADDER=8192,32768 LONG=262144
#   OUT=out LADDER= LONG=262144,327680 TESTS=0 bash dev/lora_gpu.sh
set -uo pipefail
source "$(dirname "$0")/_device_env.sh" lora_out
if [[ "${TESTS:-1}" == 1 ]]; then
    timeout "${LIMIT_TESTS:-150}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_transformers_gpu.py \
        -k "keep or lora or offload" >"$OUT/gpu_tests.log" 2>&1
fi
LADDER=${LADDER-8192,32768}
if [[ -n "$LADDER" ]]; then
    timeout "${LIMIT_LADDER:-380}" python3 -m longctx bench transformers --model llama-8b --lora --seq-lengths "$LADDER" \
        --providers hf-sdpa-ckpt,longctx-apply,longctx-apply-offload,longctx-apply-offload-keep --steps 2 --warmup 1 \
        --out-dir "$OUT/lora" --tag _ladder >"$OUT/ladder.log" 2>&1
fi
for S in $(tr , " " <<<"${LONG-262144}"); do
    [[ -z "$S" ]] && continue
    timeout "${LIMIT_LONG:-540}" python3 -m longctx bench transformers --model llama-8b --lora --seq-lengths "$S" \
        --providers longctx-apply-offload-chunks --steps 1 --warmup 0 --out-dir "$OUT/lora" --tag "_$((S / 1024))k" \
        >"$OUT/long_$S.log" 2>&1
done
