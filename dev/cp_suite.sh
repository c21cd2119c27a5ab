#!/usr/bin/env bash
# Context parallelism on 4 GPUs in one device call (nvidia-h200-x4): three independent torchrun stages, each
# under its own time limit, so that a failure or a hang in one still lets the next run.
#
#   (a) check   NCCL bf16 correctness, Triton launchers, S = 8192, Hq/Hkv = 16/4: cp_attention against a float64
#               oracle next to the single-GPU kernel, 3 masks x 3 methods x 2 layouts (QUICK: ring only)
#   (b) throughput per-GPU TFLOP/s of the suite's --cp sweep (full and causal, 16/16 heads) at 8K, 16K, 32K, 64K
#               tokens per GPU (S up to 256K), ring/allgather/ulysses against the single-GPU kernel
#               (QUICK: 16K and 32K, 3 timed calls)
#   (c) max-seq longest S that trains the 350M GPT (full recomputation, bf16, AdamW) on 1, 2 and 4 GPUs
#               under a 16 GiB cap per GPU (peak allocated + 1 GiB margin; both peaks reported): doubling
#               then bisection
#
# Time limits: 130 + 130 + 195 = 455 s at the very worst (a full run takes about 170 s); QUICK=1:
# 55 + 70 + 115 = 240 s (about 190 s).
#
#   bash dev/cp_suite.sh                      # writes under ${OUT:-cp_suite_out}
#   QUICK=1 bash dev/cp_suite.sh              # a shorter run (fewer points, ring only in the check)
#   SMOKE=1 NPROC=2 bash dev/cp_suite.sh      # the same stages on the CPU (gloo, tiny sizes): checks this script
#
# What comes back from $OUT: suite.log (everything printed, with the time of each stage) and a `longctx bench suite
# --cp` run folder per stage, $OUT/{check,throughput,maxseq}/ (check.md, summary.md, longest.md with their JSON):
# copy them to benchmarks/results/ to publish.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-cp_suite_out}
mkdir -p "$OUT"
LOG="$OUT/suite.log"
: >"$LOG"
# NVLink multicast stays off on the shared hosts (KINDS.md); autotuning off: first config of each kernel, for
# compile time within the budget (CP and the single-GPU baseline use the same kernels: like-for-like ratios).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export LONGCTX_TUNING=autotune=0 PYTHONUNBUFFERED=1
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
NPROC=${NPROC:-4}
PY=${PYTHON:-python3}
RUN=("$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" -m longctx.bench.suite --cp)
T0=$SECONDS
# what differs between the full and the QUICK call: time limits, the check's methods, the sweep's points
if [ "${QUICK:-0}" = 1 ]; then
    LIMITS=(55 70 115) BUDGET=90
    CHECK_SEL=(--cp-methods ring) SWEEP_SEL=(--cp-iters 3) TOKENS=16384,32768
else
    LIMITS=(130 130 195) BUDGET=130
    CHECK_SEL=() SWEEP_SEL=(--cp-iters 2) TOKENS=8192,16384,32768,65536
fi
# the sizes of each stage (SMOKE=1: CPU, gloo, a tiny GPT and made-up memory; for checking this script only)
if [ "${SMOKE:-0}" = 1 ]; then
    CHECK=(--device cpu --check-seqlen 64 --heads 2/2 --check-kv-heads 2 --cp-backend tiled)  # D: the default 128
    SWEEP=(--device cpu --tokens-per-gpu 64,128 --heads 2/2 --dtype fp32)
    MAXSEQ=(--device cpu --gpt-preset tiny --max-seq-start 512 --max-seq-warmup-tokens 256 --mem-cap-gib 0.001
        --fake-kib-per-token 1 --max-seq-budget-s $((BUDGET / 2)))
else
    CHECK=(--cp-backend triton --check-seqlen 8192 --heads 16/4 --check-kv-heads 4)
    SWEEP=(--tokens-per-gpu "$TOKENS" --heads 16/16)
    MAXSEQ=(--mem-cap-gib 16 --max-seq-budget-s "$BUDGET")
fi

say() { echo "$*" | tee -a "$LOG"; }

stage() {  # stage NAME LIMIT_S ARGS...: one torchrun, killed at LIMIT_S; its exit status and time logged
    local name=$1 limit=$2
    shift 2
    local t=$SECONDS
    say "=== stage $name (limit ${limit} s), start at +$((t - T0)) s: ${RUN[*]} $*"
    timeout -k 15 "$limit" "${RUN[@]}" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    say "=== stage $name: exit $rc$([ "$rc" = 124 ] && echo ' (time limit)'), $((SECONDS - t)) s (total +$((SECONDS - T0)) s)"
}

{
    nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader || true
    "$PY" -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda,
              "triton", triton.__version__, "gpus", torch.cuda.device_count())'
} 2>&1 | tee -a "$LOG"

stage check "${LIMITS[0]}" --cp-check --cp-no-sweep "${CHECK_SEL[@]}" "${CHECK[@]}" --out "$OUT/check"

stage throughput "${LIMITS[1]}" --masks full,causal "${SWEEP[@]}" "${SWEEP_SEL[@]}" --out "$OUT/throughput"

# expandable segments: the memory the allocator reserves follows what is allocated
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
stage maxseq "${LIMITS[2]}" --cp-no-sweep --max-seq --max-seq-gpus "1,2,$NPROC" --max-seq-criterion allocated \
    --max-seq-margin-gib 1 "${MAXSEQ[@]}" --out "$OUT/maxseq"
unset PYTORCH_CUDA_ALLOC_CONF

say "=== suite done in $((SECONDS - T0)) s; files in $OUT:"
ls -l "$OUT" | tee -a "$LOG"
