#!/usr/bin/env bash
# The fused RMSNorm / rotary / SwiGLU kernels (longctx.ops.pointwise) on a GPU host of 4 in one device call: their GPU
# tests and the memory model's against torch.cuda.max_memory_allocated, then `longctx train`'s packed-text step
# (dev/cp_train_gpu.sh's profiles, llama-350m at 32K) with the kernels and with LONGCTX_FUSED_POINTWISE=0, one after
# the other on the same machine. Results: $OUT/gpu_tests.log, $OUT/fused/ and $OUT/unfused/ (each cp_train.log and
# profiles.tgz: tokens/s of the median step, kernels a step, the GPU's busy share).
#
#   OUT=out bash dev/pointwise_gpu.sh            # PROFILE="one dp4 cp4:ulysses cp4" LIMIT=90 TESTS=1
set -uo pipefail
source "$(dirname "$0")/_device_env.sh" pointwise_out
if [[ "${TESTS:-1}" == 1 ]]; then
    timeout "${LIMIT_TESTS:-150}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_pointwise_gpu.py \
        tests/gpu/test_memory_gpu.py >"$OUT/gpu_tests.log" 2>&1
    tail -n 3 "$OUT/gpu_tests.log"
fi
for mode in fused unfused; do
    flag=1; [[ $mode == unfused ]] && flag=0
    echo "=== $mode (LONGCTX_FUSED_POINTWISE=$flag)"
    LONGCTX_FUSED_POINTWISE=$flag OUT="$OUT/$mode" WORK="/tmp/cp_train_$mode" LAYOUTS= \
        PROFILE="${PROFILE:-one dp4 cp4:ulysses cp4}" WARMUP="${WARMUP:-5}" PROFILE_STEPS="${PROFILE_STEPS:-10}" \
        LIMIT="${LIMIT:-90}" bash dev/cp_train_gpu.sh 2>&1 | grep -E "^===|tokens_per_s" | cut -c 1-300
done
