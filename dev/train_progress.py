"""`longctx train` with rank 0 reporting its progress inside a step, for steps longer than a device call.

Runs the trainer's own entry point with the given arguments. Rank 0 writes one line to ``--progress-log`` (flushed)
at every transformer layer's call, after synchronising the device: the seconds since the start, the call's number (the
first ``num_layers`` calls are the forward; after them, each call is one layer's recomputation in the backward, from
the last layer down), and the allocator's counters (allocated now, its peak, reserved, the allocations retried after
releasing the cache); and one line for the AdamW step (its seconds, its intra-op threads). Killed by a time limit, the
log still says how far the step got and the peak it reached.

    torchrun --nproc-per-node 4 dev/train_progress.py --progress-log out/progress.txt -- --preset llama-8b ...
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--progress-log", required=True)
    ap.add_argument("train_args", nargs=argparse.REMAINDER, help="after --: the arguments of longctx train")
    args = ap.parse_args()
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    import torch

    from longctx.memory.measure import expandable_segments

    expandable_segments()  # before the first CUDA call, as longctx train sets it

    from longctx.models import gpt
    from longctx.training import trainer

    if os.environ.get("RANK", "0") == "0" and torch.cuda.is_available():
        log = open(args.progress_log, "w", buffering=1)  # noqa: SIM115 (open for the run)
        start, calls = time.perf_counter(), [0]
        forward = gpt.TransformerLayer.forward

        def logged(self, *a, **k):
            torch.cuda.synchronize()
            stats = torch.cuda.memory_stats()
            calls[0] += 1
            gib = 2**30
            log.write(
                f"{time.perf_counter() - start:8.1f} s  call {calls[0]:4d}  "
                f"allocated {stats['allocated_bytes.all.current'] / gib:6.1f} GiB  "
                f"peak {stats['allocated_bytes.all.peak'] / gib:6.1f}  "
                f"reserved {stats['reserved_bytes.all.current'] / gib:6.1f} (peak "
                f"{stats['reserved_bytes.all.peak'] / gib:6.1f})  retries {stats.get('num_alloc_retries', 0)}\n"
            )
            return forward(self, *a, **k)

        gpt.TransformerLayer.forward = logged
        adamw_step = torch.optim.AdamW.step

        def timed_step(self, *a, **k):  # the optimizer step: its seconds and the intra-op threads it ran on
            torch.cuda.synchronize()
            t = time.perf_counter()
            out = adamw_step(self, *a, **k)
            torch.cuda.synchronize()
            log.write(f"{time.perf_counter() - start:8.1f} s  AdamW step {time.perf_counter() - t:.2f} s on "
                      f"{torch.get_num_threads()} threads\n")  # fmt: skip
            return out

        torch.optim.AdamW.step = timed_step
    return trainer.main(train_args)


if __name__ == "__main__":
    sys.exit(main())
