#!/usr/bin/env bash
# `longctx train` on packed text under DP x CP on 4 GPUs in one device call: the llama-350m preset on byte-level text
# of documents separated by '\x00' (the Python sources of the machine's site-packages: a long-tailed mix of file
# sizes, written to $WORK first), one run per layout, each under its own time limit. The last progress line of each
# run gives its tokens/s over its last steps (RecentRate).
#
# A layout is dp4, dp2cp2 or cp4, with "-dense" for one causal sequence (no document separator: the dense context
# parallelism the packed runs are held against), ":METHOD" for a context-parallel method other than METHOD (p2p) or,
# dense, METHOD_DENSE (ring), "@S" for a sequence length other than SEQ (past 32K with --memory-budget BUDGET), and
# a final "+r" for whole parameters on every data-parallel rank (--dp-shard replicate) instead of FSDP2's shards.
# With PROFILE="one cp4 ..." each named layout ("one": one GPU) first runs dev/packed_step_share.py (the step's
# tokens/s after WARMUP steps, the GPU's busy share, top kernels; a Python profile of one step for the layouts in
# PYPROF, the host synchronisations of one step for those in SYNCS, which rank the collectives of one step wait for
# in those in TIMELINE) into $WORK/profile_<layout>.json, packed into $OUT/profiles.tgz after each run.
#
#   OUT=cp_train_out bash dev/cp_train_gpu.sh   # LAYOUTS="dp4 dp2cp2 cp4 cp4-dense cp4@131072" STEPS=20 METHOD=p2p
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
METHOD_DENSE=${METHOD_DENSE:-ring}
BUDGET=${BUDGET:-130GiB}
SEQ=${SEQ:-32768}
RUN=(timeout -k 10 "${LIMIT:-150}" python3 -m torch.distributed.run --standalone)
parallel() {  # parallel LAYOUT: sets par (trainer flags), seq and dense (0/1) from NAME[-dense][:METHOD][@S][+r]
    local layout=${1%+r} name method rep=""
    [[ $1 == *+r ]] && rep=" --dp-shard replicate"
    set -- "$layout"
    name=${1%%@*}
    seq=$SEQ dense=0
    [[ $1 == *@* ]] && seq=${1##*@}
    method=$METHOD
    [[ $name == *-dense* ]] && dense=1 method=$METHOD_DENSE
    [[ $name == *:* ]] && method=${name##*:}
    name=${name%%:*}; name=${name%-dense}
    case $name in
        one) par="" ;;  # one GPU (the profile only)
        dp4) par="--data-parallel 4" ;;
        dp2cp2) par="--data-parallel 2 --context-parallel 2 --cp-method $method" ;;
        cp4) par="--context-parallel 4 --cp-method $method" ;;
        *) echo "unknown layout $1" >&2; return 1 ;;
    esac
    [ "$seq" -gt 32768 ] && par="$par --memory-budget $BUDGET"
    [[ -n "$rep" && $name == dp* ]] && par="$par$rep"
    nproc=4; [ "$name" = one ] && nproc=1
    return 0
}
for layout in ${PROFILE:-}; do
    parallel "$layout" || continue
    extra=(); [ $dense = 1 ] && extra+=(--dense)
    [[ " ${PYPROF:-} " == *" $layout "* ]] && extra+=(--python-profile 40)
    [[ " ${SYNCS:-} " == *" $layout "* ]] && extra+=(--sync-debug)
    [[ " ${TIMELINE:-} " == *" $layout "* ]] && extra+=(--rank-timeline)
    t=$SECONDS
    echo "=== profile $layout: $par, seq $seq, dense $dense" | tee -a "$LOG"
    "${RUN[@]}" --nproc-per-node $nproc dev/packed_step_share.py --data "$WORK/text.txt" --seq-length "$seq" \
        --layout "$par" "${extra[@]}" --steps "${PROFILE_STEPS:-4}" --warmup "${WARMUP:-5}" \
        --out "$WORK/profile_$(echo "$layout" | tr ':@+' '___').json" 2>&1 | grep -v "Warning\|warn\|USDT" | tail -n 3 \
        | cut -c 1-400 | tee -a "$LOG"
    echo "=== profile $layout: exit ${PIPESTATUS[0]}, $((SECONDS - t)) s" | tee -a "$LOG"
    (cd "$WORK" && tar czf "$OUT/profiles.tgz" profile_*)
done
for layout in ${LAYOUTS-dp4 dp2cp2 cp4}; do
    parallel "$layout" || continue
    docs=(--doc-separator '\x00'); [ $dense = 1 ] && docs=()
    t=$SECONDS
    echo "=== $layout: $par, seq $seq, dense $dense" | tee -a "$LOG"
    "${RUN[@]}" --nproc-per-node 4 -m longctx train --preset llama-350m --seq-length "$seq" --micro-batch-size 1 \
        --data "$WORK/text.txt" "${docs[@]}" --steps "$STEPS" --eval-iters 0 --log-interval 5 --overwrite $par \
        --save "$WORK/run_$layout" 2>&1 | grep -v "Warning\|warn" | tail -n 12 | tee -a "$LOG"
    echo "=== $layout: exit ${PIPESTATUS[0]}, $((SECONDS - t)) s" | tee -a "$LOG"
done
