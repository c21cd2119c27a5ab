#!/usr/bin/env bash
# Session 10 on the H100 (benchmarks/NOTES.md, "Session 10").
#   PART=d1: diagnostic only (benchmarks/diag_items.py): call vs kernel times of the 10% layout and causal, and the
#       per-item sweep (k kept blocks per row and column, scattered / contiguous).
#   PART=h1: host time of one forward / backward call by function (benchmarks/host_profile.py, cProfile).
set -uo pipefail
source "$(dirname "$0")/_device_env.sh" sweep_out
LOG="$OUT/sweep.txt"
clocks() { nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv,noheader >>"$LOG" 2>&1; }
case "${PART:-d1}" in
d1)
  clocks
  timeout 400 python3 benchmarks/diag_items.py --json "$OUT/diag_items_d1.json" >"$OUT/diag_items_d1.txt" 2>&1
  tail -5 "$OUT/diag_items_d1.txt" | cut -c1-300
  clocks
  python3 - "$OUT/diag_items_d1.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    if "error" in r:
        print(r["mask"], r["error"]); continue
    f, b = r["fwd"], r["bwd"]
    print(f"{r['mask']:22s} fwd call {f['call_ms']:.3f} main {f['main_us']:.0f}us {f['main_tflops']:.0f}TF "
          f"{f['us_per_block']:.2f}us/blk host {f['host_us']:.0f} | bwd call {b['call_ms']:.3f} main {b['main_us']:.0f}us "
          f"{b['main_tflops']:.0f}TF {b['us_per_block']:.2f}us/blk host {b['host_us']:.0f}")
    print("   fwd other:", f["other_kernels_us"], "\n   bwd other:", b["other_kernels_us"])
PY
  ;;
h1)
  timeout 200 python3 benchmarks/host_profile.py --n 200 --out "$OUT/host" >"$OUT/host_profile_h1.txt" 2>&1
  grep -E "^==|function calls" "$OUT/host_profile_h1.txt"
  ;;
esac
