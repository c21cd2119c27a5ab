#!/usr/bin/env bash
# Parameters in host memory on a GPU machine (one GPU; the 8B's host states need ~125 GiB of host memory, so run it
# on a kind with 256 GiB or more): the offload GPU tests, llama-8b steps at SEQS (plans of BUDGET / HOST_BUDGET), the
# longest single step at LONGEST, and the llama-350m memory benchmark as a regression check. Results: $OUT/offload.tgz.
#
#   OUT=out SEQS=32768 SEQS_SLOW=131072 bash dev/offload_gpu.sh
#   OUT=out SEQS= SEQS_SLOW= LONGEST=262144 CHECK350=0 bash dev/offload_gpu.sh
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
common=(--preset llama-8b --offload-params on --budget "$BUDGET" --host-budget "$HOST_BUDGET" --no-hf --out-dir "$R")
[[ -n "${SEQS:-}" ]] && timeout "${LIMIT_FAST:-150}" python3 -m longctx bench memory "${common[@]}" \
    --seq-lengths "$SEQS" --steps 2 --warmup 1 --tag _llama-8b_offload 2>&1 | tail -20 | tee "$R/fast.txt"
pack
[[ -n "${SEQS_SLOW:-}" ]] && timeout "${LIMIT_SLOW:-300}" python3 -m longctx bench memory "${common[@]}" \
    --seq-lengths "$SEQS_SLOW" --steps 1 --warmup 1 --tag _llama-8b_offload_long 2>&1 | tail -20 | tee "$R/slow.txt"
pack
[[ -n "${LONGEST:-}" ]] && timeout "${LIMIT_LONGEST:-480}" python3 -m longctx bench memory "${common[@]}" \
    --seq-lengths "" --longest "$LONGEST" --tag _llama-8b_offload_longest 2>&1 | tail -20 | tee "$R/longest.txt"
pack
if [[ "${CHECK350:-1}" == 1 ]]; then
    timeout "${LIMIT_350:-120}" python3 -m longctx bench memory --plans benchmarks/plans_llama-350m.json --seq-lengths 65536 \
        --longest 524288 --out-dir "$R" --tag _llama-350m_check 2>&1 | tail -12 | tee "$R/check350.txt"
fi
pack
