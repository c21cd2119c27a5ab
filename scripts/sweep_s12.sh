#!/usr/bin/env bash
# Session 12's device calls (H100), one part per call: PART=g1 ... (results under $OUT, copied to
# benchmarks/results/raw/sweeps_2026-11-21_s12/ with the part as prefix; predictions and outcomes in NOTES.md).
#   PART=g3: energy.py with the attention calls in CUDA graphs of 20 (no host time between calls), with the one-block
#            diagonal as a third mask; a repeat of the forward; the loop without graphs (host share).
#   PART=g2: the forward's O_STAGE off / on / off / on / off / on at the power cap (energy and time per call, steady).
#   PART=g1: energy per call (benchmarks/energy.py) of the 10% layout and causal at 16K (MHA and MQA) and 64K, with
#            the copy / matmul / idle calibrations; causal / 10% layout in 3 interleaved rounds at 64K; the mask
#            table's layout and causal cases at 64K.
set -uo pipefail
source "$(dirname "$0")/_device_env.sh" sweep_out
LOG="$OUT/sweep.txt"
energy() {  # $1: tag, rest: options of benchmarks/energy.py
  local tag=$1
  shift
  timeout 240 python3 benchmarks/energy.py --tag "$tag" --json "$OUT/energy_$tag.json" "$@" 2>&1 | cut -c1-400
}
case "${PART:-g1}" in
g3)
  energy graph16k --graph 20 --cases layout,causal,diag | grep case
  energy graph16k_b --graph 20 --cases layout,causal --sides fwd | grep case
  energy loop16k --cases layout,diag --sides fwd | grep case
  ;;
g2)
  for v in s0:0 s1:1 s0b:0 s1b:1 s0c:0 s1c:1; do
    IFS=: read -r tag on <<<"$v"
    LONGCTX_SPARSE_WS_O_STAGE=$on energy "o_stage_$tag" --cases layout,causal --sides fwd --secs 3 | grep case
  done
  ;;
g1)
  nvidia-smi --query-gpu=name,power.limit,power.max_limit,clocks.max.sm --format=csv >>"$LOG" 2>&1
  energy mha16k --s 16384
  energy mqa16k --s 16384 --hkv 1 --cases layout,causal
  energy mha64k --s 65536 --cases layout,causal
  timeout 200 python3 benchmarks/diag_items.py --s 65536 --skip-items --ratio 3 --json "$OUT/ratio_64k.json" \
    2>&1 | tail -1 | cut -c1-600
  timeout 300 python3 -m longctx.bench.masks --layout-s 65536 --cases layout,causal --no-build --out-dir "$OUT" \
    --tag _s12_64k >>"$LOG" 2>&1
  grep -E "^\| (random|causal)" "$LOG" | cut -c1-250
  ;;
esac
