#!/usr/bin/env bash
# The full kernel mode of `longctx bench suite` on one H100: S = 4K, 16K, 64K, every mask of the catalogue, every
# provider, the document masks over seeds 0, 1, 2 (LongCA's settings: batch 1, 64 query / 8 kv heads, D 128, bf16).
# Writes $OUT/suite_<gpu>/ (results.csv, results.json, summary.md, PNGs); copy it to benchmarks/results/.
#
# Budget: under 9 minutes on one H100. do_bench runs 5 ms of warm-up and 20 ms of repetitions per timing; no case
# starts after 400 s (--budget-s; later cases are recorded as "skipped"), FlexAttention's compiles stop after 180 s
# of its own time (--provider-budget-s applies to every provider; the others stay far below it), tiled runs up to
# 4K and math where its S x S scores fit; the mask build timings at 64K and start-up take the rest.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
PY=${PYTHON:-python}
GPU=$($PY -c "import torch; print(torch.cuda.get_device_name().replace('NVIDIA ', '').replace(' ', '-'))")
$PY -m longctx.bench.suite \
    --s 4096,16384,65536 --masks all --providers all --seeds 0,1,2 \
    --warmup 5 --rep 20 --budget-s 400 --provider-budget-s 180 \
    --out "$OUT/suite_$GPU"
