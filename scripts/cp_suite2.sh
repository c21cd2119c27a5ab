#!/usr/bin/env bash
# Context parallelism on 4 GPUs, second call (nvidia-h200-x4, <= 240 s wall): after the ring's buffer rotation
# and fewer float32 passes (src/longctx/distributed/ring.py, blocks.py), three time-limited torchrun stages:
#
#   (a) check   NCCL bf16 correctness of the ring only (zigzag + contiguous, 3 masks), Triton launchers,
#               S = 8192, Hkv = 4, against a float64 oracle next to the single-GPU kernel   (limit  55 s)
#   (b) sweep   per-GPU TFLOP/s of forward+backward at 16K and 32K tokens per GPU, ring / allgather / ulysses
#               with zigzag, against the single-GPU kernel; 2 warm-ups, 3 timed calls       (limit  70 s)
#   (c) max-seq longest S that trains the 350M GPT on 1, 2 and 4 GPUs under 16 GiB per GPU, criterion
#               peak allocated + 1 GiB margin (both peaks reported), budget 90 s             (limit 115 s)
#
# Run 5 (scripts/cp_suite.sh) took 48 + ~60 + 48 s for the bigger versions of these stages. Worst case here:
# 55 + 70 + 115 = 240 s. TORCH_NCCL_AVOID_RECORD_STREAMS=1: NCCL keeps its tensors alive until wait() instead
# of recordStream, so the allocator can reuse a freed block in stream order (reserved closer to allocated).
#
#   bash scripts/cp_suite2.sh                     # writes under ${OUT:-cp_suite_out}
#   SMOKE=1 NPROC=2 bash scripts/cp_suite2.sh     # the same stages on the CPU (gloo, tiny sizes)
#
# Files under $OUT: suite.log and cp_<date>_H200x4_{check2,sweep2,maxseq2}.{md,json}.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-cp_suite_out}
mkdir -p "$OUT"
LOG="$OUT/suite.log"
: >"$LOG"
# NVLink multicast stays off on the shared hosts (KINDS.md); autotuning off: first config of each kernel, for
# compile time within the budget (CP and the single-GPU baseline use the same kernels: like-for-like ratios).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export LONGCTX_TRITON_AUTOTUNE=0 PYTHONUNBUFFERED=1 TORCH_NCCL_AVOID_RECORD_STREAMS=1
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
NPROC=${NPROC:-4}
PY=${PYTHON:-python3}
RUN=("$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" benchmarks/bench_cp.py --out-dir "$OUT")
T0=$SECONDS
# the sizes of each stage (SMOKE=1: CPU, gloo, a tiny GPT and made-up memory; for checking this script only)
if [ "${SMOKE:-0}" = 1 ]; then
    CHECK=(--device cpu --check-seqlen 64 --heads 2 --check-kv-heads 2 --head-dim 16 --backend tiled)
    SWEEP=(--device cpu --tokens-per-gpu 64,128 --heads 2 --kv-heads 2 --head-dim 16 --backend tiled)
    MAXSEQ=(--device cpu --gpt-preset tiny --max-seq-start 512 --max-seq-warmup-tokens 256 --mem-cap-gib 0.001
        --fake-kib-per-token 1 --max-seq-budget-s 30)
else
    CHECK=(--backend triton --check-seqlen 8192)
    SWEEP=(--backend triton --tokens-per-gpu 16384,32768)
    MAXSEQ=(--mem-cap-gib 16 --max-seq-budget-s 90)
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

stage check 55 --check --no-bench --methods ring "${CHECK[@]}" --tag _check2

stage sweep 70 "${SWEEP[@]}" --layouts zigzag --warmup 2 --iters 3 --tag _sweep2

# expandable segments: the memory the allocator reserves follows what is allocated (what the cap is checked on)
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
stage maxseq 115 --no-bench --max-seq --max-seq-gpus "1,2,$NPROC" --max-seq-criterion allocated --max-seq-margin-gib 1 \
    "${MAXSEQ[@]}" --tag _maxseq2
unset PYTORCH_CUDA_ALLOC_CONF

say "=== suite done in $((SECONDS - T0)) s; files in $OUT:"
ls -l "$OUT" | tee -a "$LOG"
