#!/usr/bin/env bash
# Packed documents under context parallelism on 4 GPUs in one device call: correctness of every method against a
# float64 oracle (dev/cp_docs_check.py), then `longctx bench suite --cp` on a short mix (every document shorter than
# a shard) and a long mix (documents up to the whole sequence), 16K tokens per GPU, against one GPU on the whole
# sequence (--cp-whole), for 16 / 4 and 64 / 8 heads. Each stage under its own time limit.
#
#   OUT=cp_docs_out bash dev/cp_docs_gpu.sh  # HEADS="16/4" MIXES=short to run one setting; CHECK=0: no check stage
set -uo pipefail
source "$(dirname "$0")/_device_env.sh" cp_docs_out
# what comes back is at most 8 files: the stages write under WORK, packed into $OUT/cp_docs.tgz after each stage
WORK=${WORK:-/tmp/cp_docs}
mkdir -p "$WORK"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NPROC=${NPROC:-4}
TOKENS=${TOKENS:-16384}
LOG="$WORK/cp_docs.log"
: >"$LOG"
RUN=(python3 -m torch.distributed.run --standalone --nproc-per-node "$NPROC")
stage() {  # stage NAME LIMIT_S ARGS...
    local name=$1 limit=$2 t=$SECONDS
    shift 2
    echo "=== $name (limit ${limit} s)" | tee -a "$LOG"
    timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$LOG"
    echo "=== $name: exit ${PIPESTATUS[0]}, $((SECONDS - t)) s" | tee -a "$LOG"
    tar czf "$OUT/cp_docs.tgz" -C "$WORK" .
}
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee -a "$LOG"
[ "${CHECK:-1}" = 1 ] && stage check "${CHECK_LIMIT:-150}" "${RUN[@]}" dev/cp_docs_check.py --out "$WORK"
for heads in ${HEADS:-16/4 64/8}; do
    for mix in ${MIXES:-short long}; do
        if [ "$mix" = short ]; then cap=$TOKENS median=1024; else cap=$((TOKENS * NPROC)) median=$TOKENS; fi
        tag="${heads/\//x}_$mix"
        stage "suite $tag" "${SUITE_LIMIT:-150}" "${RUN[@]}" -m longctx.bench.suite --cp --cp-whole \
            --tokens-per-gpu "$TOKENS" --heads "$heads" --seeds 0 --masks causal,document,causal_document \
            --doc-cap "$cap" --doc-median "$median" --cp-methods ring,allgather,ulysses,ulysses_ring,p2p \
            --out "$WORK/suite_$tag"
    done
done
