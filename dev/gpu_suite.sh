#!/usr/bin/env bash
# The GPU lane, run by hand on a CUDA machine: versions, the oracle check of every backend, and the GPU test
# modules (extra arguments go to pytest). Writes logs under ${OUT:-gpu_out}; the last line of gpu_tests.txt names the
# tier and part that ran and pytest's summary.
#
#   OUT=gpu_out bash dev/gpu_suite.sh                     # quick tier: every GPU test function, every parameter value
#   OUT=gpu_out TIER=full PART=1/3 bash dev/gpu_suite.sh  # the full matrix, first of three parts
#   OUT=gpu_out bash dev/gpu_suite.sh -k hopper           # extra arguments go to pytest
#   OUT=gpu_out CHECK=0 TIER=full PART=2/3 bash dev/gpu_suite.sh  # without `longctx check` (run it in one part)
#
# Tiers (tests/conftest.py): quick keeps, per test function, the fewest cases that take every value of every
# parameter once (every kernel path, head dim, band and dtype); full is every case, split into PART=K/N interleaved
# parts so each fits a 10-minute call. WORKERS xdist workers share the GPU (default 12; each test gives its cached
# memory back, tests/gpu/conftest.py, so the memory-model tests fit beside the others). On an H100 with an empty
# Triton cache the quick tier took about 3 minutes of pytest with 12 workers (longctx check runs before it), the full
# tier about 5 (PART=1/3, 2/3, 3/3: 88-107 s each).
set -uo pipefail
source "$(dirname "$0")/_device_env.sh" gpu_out
TIER="${TIER:-quick}"
select=(--gpu-tier "$TIER")
[[ -n "${PART:-}" ]] && select+=(--gpu-part "$PART")
python3 -m longctx info 2>&1 | tee "$OUT/info.txt"
[[ "${CHECK:-1}" == 1 ]] && python3 -m longctx check 2>&1 | tee "$OUT/check.txt"
start=$(date +%s)
python3 -m pytest -q -p no:cacheprovider -n "${WORKERS:-12}" -m gpu "${select[@]}" "${@:-tests/gpu}" 2>&1 \
    | tee "$OUT/gpu_tests.txt"
status=${PIPESTATUS[0]}
summary=$(grep -E "(passed|failed|error)" "$OUT/gpu_tests.txt" | tail -1)
echo "tier=$TIER part=${PART:-all} workers=${WORKERS:-12} seconds=$(( $(date +%s) - start )) rc=$status: $summary" \
    | tee -a "$OUT/gpu_tests.txt"
exit "$status"
