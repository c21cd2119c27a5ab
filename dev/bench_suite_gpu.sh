#!/usr/bin/env bash
# The kernel mode of `longctx bench suite` on one H100, in three runs that each fit a 10-minute GPU call, merged
# into one report: S = 4K with every provider (the references included) and the document masks over seeds 0, 1, 2;
# S = 16K with longctx, cuDNN and FlexAttention over seeds 0, 1, 2; S = 64K with the same providers and seed 0.
# LongCA's settings: batch 1, 64 query / 8 kv heads, D 128, bf16. Writes $OUT/suite_<gpu>/ (results.csv,
# results.json, summary.md, PNGs); copy it to benchmarks/results/.
#
# Time: about 7.5 minutes for the 4K run (FlexAttention's compiles and the tiled/math references take most of it),
# 2.5 for 16K and 3.5 for 64K. Each run stops starting cases at its --budget-s and records the rest as "skipped";
# run them as separate calls (PART=4k|16k|64k|merge) where one call has a time limit.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
PY=${PYTHON:-python}
PART=${PART:-all}
GPU=$($PY -c "import torch; print(torch.cuda.get_device_name().replace('NVIDIA ', '').replace(' ', '-'))")
RUNS="$OUT/suite_runs"
FAST=longctx_auto,longctx_triton,longctx_triton_sparse,cudnn,flex
if [[ $PART == all || $PART == 4k ]]; then
    $PY -m longctx.bench.suite --s 4096 --masks all --providers all --seeds 0,1,2 \
        --warmup 5 --rep 20 --budget-s 420 --provider-budget-s 180 --no-build-timing --out "$RUNS/4k"
fi
if [[ $PART == all || $PART == 16k ]]; then
    $PY -m longctx.bench.suite --s 16384 --masks all --providers $FAST --seeds 0,1,2 \
        --warmup 5 --rep 20 --budget-s 200 --provider-budget-s 150 --no-build-timing --out "$RUNS/16k"
fi
if [[ $PART == all || $PART == 64k ]]; then
    $PY -m longctx.bench.suite --s 65536 --masks all --providers $FAST --seeds 0 \
        --warmup 5 --rep 15 --budget-s 190 --provider-budget-s 150 --out "$RUNS/64k"
fi
if [[ $PART == all || $PART == merge ]]; then
    $PY -m longctx.bench.suite --merge "$RUNS/4k" "$RUNS/16k" "$RUNS/64k" --out "$OUT/suite_$GPU"
fi
