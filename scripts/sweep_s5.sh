#!/usr/bin/env bash
# Session 5 on the H100 (benchmarks/NOTES.md, "Session 5"): the warp-specialised forward (kernels/flash_fwd_ws.py).
#   PART=ws1: a smoke test (fails fast with the traceback), the GPU tests of the new kernel and of the Triton
#       backend (which now takes it for D in {64, 128}), then the sweep beside the Triton forward and cuDNN.
#   PART=ws2: after the rule (`triton_flash._ws_config`): the GPU tests of the Triton backend, the new kernel and
#       the backends, then the attention table at D=128 and GQA (ours, cuDNN, FA2).
#   PART=ws3: the table at D=64, then the causal configs again (4K: 2 vs 3 stages; 64-wide key tiles).
#   PART=t128: the D=128 and GQA rows of the table alone (ws2 ran on an H200: no H100 was free).
set -uo pipefail
source "$(dirname "$0")/_device_env.sh" sweep_out
LOG="$OUT/sweep.txt"
clocks() { nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv,noheader >>"$LOG" 2>&1; }
case "${PART:-ws1}" in
ws1)
  clocks
  timeout 120 python3 benchmarks/sweep_ws.py --d 128 --s 2048 --causal 0,1 --ws "128,2,1;128,2,0" --rep 20 \
    >>"$LOG" 2>&1
  tail -4 "$LOG"
  LONGCTX_TRITON_AUTOTUNE=0 timeout 200 python3 -m pytest -q -p no:cacheprovider -n 6 -m gpu -x \
    tests/gpu/test_ws_gpu.py >>"$LOG" 2>&1
  tail -4 "$LOG"
  timeout 200 python3 benchmarks/sweep_ws.py --d 128,64 --s 4096,8192,16384 --causal 0,1 \
    --ws "128,2,1;128,2,0;64,3,1;128,3,1" --json "$OUT/ws1.json" >>"$LOG" 2>&1
  clocks
  grep '^{' "$LOG" | tail -12
  ;;
ws2)
  clocks
  LONGCTX_TRITON_AUTOTUNE=0 timeout 230 python3 -m pytest -q -p no:cacheprovider -n 6 -m gpu \
    tests/gpu/test_triton_gpu.py tests/gpu/test_ws_gpu.py tests/gpu/test_backends_gpu.py >>"$LOG" 2>&1
  tail -3 "$LOG"
  clocks
  timeout 330 python3 -m longctx bench attention --providers triton,cudnn,fa2 --d 128 --out-dir "$OUT" \
    --tag _s5_d128 >>"$LOG" 2>&1
  clocks
  tail -45 "$LOG" | grep -E "^\| D=|MHz"
  ;;
ws3)
  clocks
  timeout 250 python3 -m longctx bench attention --providers triton,cudnn,fa2 --d 64 --no-gqa --out-dir "$OUT" \
    --tag _s5_d64 >>"$LOG" 2>&1
  clocks
  timeout 200 python3 benchmarks/sweep_ws.py --d 128,64 --s 2048,4096,8192 --causal 1 --peers triton \
    --ws "128,2,1;128,3,1;64,4,1;64,3,0" --json "$OUT/ws3.json" >>"$LOG" 2>&1
  clocks
  grep -E "^\| D=|^\{" "$LOG" | tail -16
  ;;
t128)
  clocks
  timeout 400 python3 -m longctx bench attention --providers triton,cudnn,fa2 --d 128 --out-dir "$OUT" \
    --tag _s5_d128 >>"$LOG" 2>&1
  clocks
  grep -E "^\| D=|MHz" "$LOG" | head -17
  ;;
*)
  echo "sweep_s5.sh: unknown PART=${PART} (ws1, ws2, ws3, t128)" >&2
  exit 2
  ;;
esac
