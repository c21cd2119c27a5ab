"""Spawn a gloo world once and collect each rank's results (shared by the distributed test modules).

The worker, ``worker(rank, world, store_path, out_dir)``, writes its results to ``<out_dir>/rank<r>.json`` (after
every case, so a hang still leaves the record). Ranks still alive at the deadline are killed.
"""

from __future__ import annotations

import datetime
import json
import os
import tempfile
from collections.abc import Callable


def spawn_world(
    worker: Callable[[int, int, str, str], None], world: int, timeout_s: float
) -> tuple[list[dict], list[int]]:
    """Run ``worker`` on ``world`` spawned processes; returns (each rank's results, the ranks killed as hung)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [ctx.Process(target=worker, args=(r, world, store_path, tmp)) for r in range(world)]
        for p in procs:
            p.start()
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
        for p in procs:
            p.join(timeout=max(1.0, (deadline - datetime.datetime.now()).total_seconds()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for r in hung:
            procs[r].kill()
            procs[r].join()
        per_rank = []
        for r in range(world):
            try:
                with open(os.path.join(tmp, f"rank{r}.json")) as f:
                    per_rank.append(json.load(f))
            except FileNotFoundError:
                per_rank.append({})
    return per_rank, hung
