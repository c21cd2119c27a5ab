#!/usr/bin/env bash
# The GPU lane, run by hand on a CUDA machine: versions, the oracle check of every backend, and the GPU test
# modules (extra arguments go to pytest). Writes logs under ${OUT:-gpu_out}.
#
#   OUT=gpu_out bash dev/gpu_suite.sh [-k hopper]
#
# Tiers: the whole GPU suite is the quick tier (every kernel path once: dense, block-sparse, warp-specialised,
# softcap, varlen, CP size 1, memory model, transformers), run with WORKERS xdist workers on one GPU (default 8:
# 14 workers ran the H100 out of memory once the memory-model tests overlapped the others). Each module also runs
# alone (`bash dev/gpu_suite.sh tests/gpu/test_flash_kernels.py`) as a part of the matrix.
set -uo pipefail
source "$(dirname "$0")/_device_env.sh" gpu_out
python3 -m longctx info 2>&1 | tee "$OUT/info.txt"
python3 -m longctx check 2>&1 | tee "$OUT/check.txt"
python3 -m pytest -q -p no:cacheprovider -n "${WORKERS:-8}" -m gpu "${@:-tests/gpu}" 2>&1 | tee "$OUT/gpu_tests.txt"
