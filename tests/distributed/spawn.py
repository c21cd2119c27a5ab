"""Spawn a gloo world once and collect each rank's results (shared by the distributed test modules).

The worker, ``worker(rank, world, store_path, out_dir)``, writes its results to ``<out_dir>/rank<r>.json`` (after
every case, so a hang still leaves the record). Ranks still alive at the deadline are killed. `run_case_world` is
the common worker: every rank runs a test module's named cases in order and records "ok" or the error.
"""

from __future__ import annotations

import datetime
import functools
import importlib
import json
import os
import tempfile
import traceback
from collections.abc import Callable

SKIPPED = "skipped: "


class CaseSkipped(Exception):
    """Raised by a case that cannot run on this machine; the test reports it as skipped, with the reason."""


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


def _case_worker(module: str, env: dict[str, str], rank: int, world: int, store_path: str, out_dir: str) -> None:
    """One rank of `run_case_world`: ``env`` set, a gloo group, then ``module``'s ``_run_case(name, rank, world)``
    for each of its ``case_names(world)``, each recorded as "ok" or its error and traceback."""
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    cases = importlib.import_module(module)
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    results = {}
    path = os.path.join(out_dir, f"rank{rank}.json")
    try:
        for name in cases.case_names(world):
            try:
                cases._run_case(name, rank, world)
                results[name] = "ok"
            except CaseSkipped as e:
                results[name] = SKIPPED + str(e)
            except Exception as e:  # noqa: BLE001 - reported per case
                results[name] = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}"
            with open(path + ".tmp", "w") as f:  # written after every case: a hang still leaves the record
                json.dump(results, f)
            os.replace(path + ".tmp", path)
    finally:
        dist.destroy_process_group()


def run_case_world(
    module: str, world: int, timeout_s: float, env: dict[str, str] | None = None
) -> dict[str, list[str]]:
    """Run the cases of test module ``module`` (its ``case_names(world)`` and ``_run_case``) on a gloo world of
    ``world`` ranks, with ``env`` added to each rank's environment; returns case name -> each rank's "ok" or error
    text (a case a hung or crashed world never reached says so)."""
    per_rank, hung = spawn_world(functools.partial(_case_worker, module, env or {}), world, timeout_s)
    names = importlib.import_module(module).case_names(world)
    missing = "did not run (the world hung or crashed)" + (f"; ranks {hung} killed" if hung else "")
    return {name: [pr.get(name, missing) for pr in per_rank] for name in names}


def case_params(worlds, case_names: Callable[[int], list[str]], group: str) -> list:
    """pytest params ``(world, name)`` of every case at every world size, ids ``P<world>-<name>``; each world's
    cases share the xdist group ``<group>_world<world>``, so one worker spawns that world once for all of them."""
    import pytest

    return [
        pytest.param(w, n, marks=pytest.mark.xdist_group(name=f"{group}_world{w}"), id=f"P{w}-{n}")
        for w in worlds
        for n in case_names(w)
    ]


def assert_ranks_ok(results: list[str]) -> None:
    """Every rank's result of one case is "ok" (or every rank skipped it: the test is skipped with the reason);
    else the failing ranks and their errors."""
    import pytest

    if results and all(res.startswith(SKIPPED) for res in results):
        pytest.skip(results[0][len(SKIPPED) :])
    failed = {r: res for r, res in enumerate(results) if res != "ok"}
    assert not failed, "\n".join(f"rank {r}: {res}" for r, res in failed.items())
