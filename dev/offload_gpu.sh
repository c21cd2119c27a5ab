#!/usr/bin/env bash
# Parameters in host memory on a GPU machine (one GPU; the 8B's host states need ~125 GiB of host memory, so run it
# on a kind with 256 GiB or more): the offload GPU tests, llama-8b steps at SEQS (plans of BUDGET / HOST_BUDGET), the
# longest single step at LONGEST, and the llama-350m memory benchmark as a regression check. Results: $OUT/offload.tgz.
#
# PRESET picks another model (llama-3b's states fit a 128 GiB host); OVERLAP=1 runs SEQS a second time with the host's
# AdamW step in place (--host-step in-place), beside the default one behind the next forward; TRAIN_SEQ runs
# `longctx train` on the offloaded preset at that length for TRAIN_STEPS steps; RESIDENT_AB=N runs SEQS again with N
# units resident on the GPU (--resident-units), beside the plan's own choice.
#
#   OUT=out SEQS=32768 SEQS_SLOW=131072 bash dev/offload_gpu.sh
#   OUT=out SEQS= SEQS_SLOW= LONGEST=262144 CHECK350=0 bash dev/offload_gpu.sh
#   OUT=out PRESET=llama-3b HOST_BUDGET=110GiB SEQS=32768 OVERLAP=1 TRAIN_SEQ=32768 TESTS=0 bash dev/offload_gpu.sh
set -uo pipefail
source "$(dirname "$0")/_device_env.sh" offload_out
R="$OUT/results"; mkdir -p "$R"
BUDGET=${BUDGET:-135GiB}; HOST_BUDGET=${HOST_BUDGET:-230GiB}
pack() { tar czf "$OUT/offload.tgz" -C "$OUT" results; }  # after every stage: a call cut short keeps what ran
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$R/gpu.txt"
grep MemTotal /proc/meminfo | tee -a "$R/gpu.txt"; nproc | tee -a "$R/gpu.txt"
if [[ "${TESTS:-1}" == 1 ]]; then
    timeout "${LIMIT_TESTS:-100}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_offload_gpu.py 2>&1 | tail -15 \
        | tee "$R/offload_tests.txt"
    pack
fi
PRESET=${PRESET:-llama-8b}
common=(--preset "$PRESET" --offload-params on --budget "$BUDGET" --host-budget "$HOST_BUDGET" --no-hf --out-dir "$R")
[[ -n "${SEQS:-}" ]] && timeout "${LIMIT_FAST:-150}" python3 -m longctx bench memory "${common[@]}" \
    --seq-lengths "$SEQS" --steps 2 --warmup 1 --tag "_${PRESET}_offload" 2>&1 | tail -20 | tee "$R/fast.txt"
pack
[[ -n "${SEQS:-}" && "${OVERLAP:-0}" == 1 ]] && timeout "${LIMIT_FAST:-150}" python3 -m longctx bench memory \
    "${common[@]}" --seq-lengths "$SEQS" --steps 2 --warmup 1 --host-step in-place --tag "_${PRESET}_offload_in-place" \
    2>&1 | tail -20 | tee "$R/fast_in-place.txt"
pack
[[ -n "${SEQS:-}" && -n "${RESIDENT_AB:-}" ]] && timeout "${LIMIT_FAST:-150}" python3 -m longctx bench memory \
    "${common[@]}" --seq-lengths "$SEQS" --steps 2 --warmup 1 --resident-units "$RESIDENT_AB" \
    --tag "_${PRESET}_offload_resident-${RESIDENT_AB}" 2>&1 | tail -20 | tee "$R/fast_resident.txt"
pack
if [[ -n "${TRAIN_SEQ:-}" ]]; then
    timeout "${LIMIT_TRAIN:-200}" python3 -m longctx train --preset "$PRESET" --offload-params true \
        --seq-length "$TRAIN_SEQ" --train-iters "${TRAIN_STEPS:-8}" --eval-iters 0 --log-interval 1 --save none \
        2>&1 | tail -25 | tee "$R/train.txt"
    pack
fi
[[ -n "${SEQS_SLOW:-}" ]] && timeout "${LIMIT_SLOW:-300}" python3 -m longctx bench memory "${common[@]}" \
    --seq-lengths "$SEQS_SLOW" --steps 1 --warmup 1 --tag "_${PRESET}_offload_long" 2>&1 | tail -20 | tee "$R/slow.txt"
pack
[[ -n "${LONGEST:-}" ]] && timeout "${LIMIT_LONGEST:-480}" python3 -m longctx bench memory "${common[@]}" \
    --seq-lengths "" --longest "$LONGEST" --tag "_${PRESET}_offload_longest" 2>&1 | tail -20 | tee "$R/longest.txt"
pack
if [[ "${CHECK350:-1}" == 1 ]]; then
    timeout "${LIMIT_350:-120}" python3 -m longctx bench memory --plans benchmarks/plans_llama-350m.json --seq-lengths 65536 \
        --longest 524288 --out-dir "$R" --tag _llama-350m_check 2>&1 | tail -12 | tee "$R/check350.txt"
fi
pack
