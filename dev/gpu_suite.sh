#!/usr/bin/env bash
# The GPU lane, run by hand on a CUDA machine: versions, the oracle check of every backend, and the GPU test
# modules (extra arguments go to pytest). Writes logs under ${OUT:-gpu_out}.
#
#   OUT=gpu_out bash dev/gpu_suite.sh [-k hopper]
set -uo pipefail
source "$(dirname "$0")/_device_env.sh" gpu_out
python3 -m longctx info 2>&1 | tee "$OUT/info.txt"
python3 -m longctx check 2>&1 | tee "$OUT/check.txt"
python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu "$@" 2>&1 | tee "$OUT/gpu_tests.txt"
