#!/usr/bin/env bash
# `longctx train` on packed text under DP x CP on 4 GPUs in one device call: the llama-350m preset at 32K tokens per
# sequence on byte-level text of documents separated by '\x00' (the Python sources of the machine's site-packages:
# a long-tailed mix of file sizes, written to $WORK first), one run per layout, each under its own time limit.
# The last progress line of each run gives its tokens/s over its last steps (RecentRate).
#
#   OUT=cp_train_out bash dev/cp_train_gpu.sh      # LAYOUTS="dp4 dp2cp2 cp4" STEPS=20 METHOD=p2p
set -uo pipefail
source "$(dirname "$0")/_device_env.sh" cp_train_out
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
WORK=${WORK:-/tmp/cp_train}
mkdir -p "$WORK"
LOG="$OUT/cp_train.log"
: >"$LOG"
python3 -c 'import sys; sys.path.insert(0, "dev"); from packed_step_share import site_packages_text
print(f"text: {site_packages_text(sys.argv[1], 200_000_000) / 1e6:.0f} MB", flush=True)' "$WORK/text.txt"
STEPS=${STEPS:-20}
METHOD=${METHOD:-p2p}
COMMON=(--preset llama-350m --seq-length 32768 --micro-batch-size 1 --data "$WORK/text.txt" --doc-separator '\x00'
        --steps "$STEPS" --eval-iters 0 --log-interval 5 --overwrite)
for layout in ${LAYOUTS:-dp4 dp2cp2 cp4}; do
    case $layout in
        dp4) par=(--data-parallel 4) ;;
        dp2cp2) par=(--data-parallel 2 --context-parallel 2 --cp-method "$METHOD") ;;
        cp4) par=(--context-parallel 4 --cp-method "$METHOD") ;;
    esac
    t=$SECONDS
    echo "=== $layout: ${par[*]}" | tee -a "$LOG"
    timeout -k 10 "${LIMIT:-150}" python3 -m torch.distributed.run --standalone --nproc-per-node 4 -m longctx train \
        "${COMMON[@]}" "${par[@]}" --save "$WORK/run_$layout" 2>&1 | grep -v "Warning\|warn" | tail -n 12 | tee -a "$LOG"
    echo "=== $layout: exit ${PIPESTATUS[0]}, $((SECONDS - t)) s" | tee -a "$LOG"
done
