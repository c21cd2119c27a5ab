#!/usr/bin/env bash
# llama-8b under context parallelism with parameters, gradients and optimizer states in host memory, on one host of
# NPROC GPUs: one whole training step (forward, backward, the CPU AdamW step) at S tokens with the plan `longctx train`
# picks for BUDGET per GPU and HOST_BUDGET for the host. Beside the trainer's output (the plan and its predicted GPU
# and host peaks, the step's time, rank 0's torch peak), the host's used memory and every GPU's used memory are
# sampled each second; $OUT/cp_8b_peaks.txt gives their peaks (the host's above its use before the run). The whole
# output of the run: $OUT/cp_8b_train.log.
#
#   OUT=out S=655360 bash dev/cp_8b_gpu.sh  # NPROC=4 METHOD=ring BUDGET=135GiB HOST_BUDGET=480GiB SNAPSHOT=0 PROGRESS=0
set -uo pipefail
source "$(dirname "$0")/_device_env.sh" cp_8b_out
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
S=${S:-655360}; NPROC=${NPROC:-4}; METHOD=${METHOD:-ring}
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$OUT/cp_8b.log"
grep -E "MemTotal|MemAvailable" /proc/meminfo | tee -a "$OUT/cp_8b.log"
before=$(free -b | awk '/Mem:/{print $3}')
(while true; do
    echo "$(free -b | awk '/Mem:/{print $3}') $(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | paste -sd' ')"
    sleep 1
done) >"$OUT/cp_8b_samples.txt" &
sampler=$!
t=$SECONDS
entry=(-m longctx train)  # SNAPSHOT=1: rank 0 records the allocator's history (dev/memory_snapshot.py) into $OUT/snap.tgz
[[ "${SNAPSHOT:-0}" == 1 ]] && entry=(dev/memory_snapshot.py --snapshot-dir "$OUT/snap" --max-entries 100000 --)
# PROGRESS=1: rank 0 logs every layer call with the allocator's counters (dev/train_progress.py) into
# $OUT/progress.txt: how far a step longer than the time limit got, and its peak so far
[[ "${PROGRESS:-0}" == 1 ]] && entry=(dev/train_progress.py --progress-log "$OUT/progress.txt" --)
timeout -k 10 "${LIMIT:-540}" python3 -m torch.distributed.run --standalone --nproc-per-node "$NPROC" "${entry[@]}" \
    --preset llama-8b --seq-length "$S" --micro-batch-size 1 --context-parallel "$NPROC" --cp-method "$METHOD" --offload-params true \
    --memory-budget "${BUDGET:-135GiB}" --host-memory-budget "${HOST_BUDGET:-480GiB}" --steps 1 --eval-iters 0 \
    --log-interval 1 --save none >"$OUT/cp_8b_train.log" 2>&1
echo "exit $? after $((SECONDS - t)) s" | tee -a "$OUT/cp_8b.log"
[[ -d "$OUT/snap" ]] && tar czf "$OUT/snap.tgz" -C "$OUT" snap && rm -rf "$OUT/snap"
# the trainer's own lines and any error, without torchrun's failure report
grep -v "Warning\|warn\|^\s*\(time\|host\|rank\|exitcode\|error_file\|traceback\)\s*:" "$OUT/cp_8b_train.log" \
    | grep -E "memory plan|longctx train|tok/s|summary|steps|peak|Error|error" | head -n 30 | tee -a "$OUT/cp_8b.log"
kill "$sampler"
python3 - "$OUT/cp_8b_samples.txt" "$before" <<'PY' | tee "$OUT/cp_8b_peaks.txt"
import sys
rows = [[int(x) for x in line.split()] for line in open(sys.argv[1]) if line.strip()]
before = int(sys.argv[2])
print(f"samples {len(rows)}; host used above the start: peak {(max(r[0] for r in rows) - before) / 2**30:.1f} GiB")
for g in range(len(rows[0]) - 1):
    print(f"GPU {g}: peak used {max(r[g + 1] for r in rows) / 1024:.1f} GiB (nvidia-smi)")
PY
