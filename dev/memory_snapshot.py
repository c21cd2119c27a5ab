"""`longctx train` with the CUDA caching allocator's history recorded on rank 0: what holds the memory the allocator
reserves beyond what is allocated (the 8B's context-parallel step reserves 1.29x its allocated peak).

Runs the trainer's own entry point with the given arguments; rank 0 records every allocation and free with its stack
(`torch.cuda.memory._record_memory_history`) and at the end writes the snapshot (open it at pytorch.org/memory_viz)
and a JSON of the allocator's counters (`torch.cuda.memory_stats`: reserved, allocated, inactive split bytes, the
segments, allocation retries) to ``--snapshot-dir``.

    torchrun --nproc-per-node 4 dev/memory_snapshot.py --snapshot-dir out -- --preset llama-8b --seq-length 262144 ...
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--snapshot-dir", required=True)
    ap.add_argument("--max-entries", type=int, default=200_000)
    ap.add_argument("train_args", nargs=argparse.REMAINDER, help="after --: the arguments of longctx train")
    args = ap.parse_args()
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    import torch

    from longctx.memory.measure import expandable_segments

    expandable_segments()  # before the first CUDA call, as longctx train sets it

    from longctx.training import trainer

    rank0 = os.environ.get("RANK", "0") == "0" and torch.cuda.is_available()
    if rank0:
        torch.cuda.memory._record_memory_history(max_entries=args.max_entries)
    try:
        code = trainer.main(train_args)
    finally:
        if rank0:
            os.makedirs(args.snapshot_dir, exist_ok=True)
            torch.cuda.memory._dump_snapshot(os.path.join(args.snapshot_dir, "snapshot_rank0.pickle"))
            stats = torch.cuda.memory_stats()
            keep = ("reserved_bytes", "allocated_bytes", "active_bytes", "inactive_split_bytes", "segment",
                    "num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free")  # fmt: skip
            with open(os.path.join(args.snapshot_dir, "memory_stats_rank0.json"), "w") as f:
                json.dump({k: v for k, v in stats.items() if k.startswith(keep)}, f, indent=1, sort_keys=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
