"""Data parallelism x context parallelism (`longctx.distributed.mesh`, `longctx train --data-parallel`) on gloo.

Worlds of 2 and 4 processes each run every case once (spawned, a FileStore in a temporary directory). A valid case
builds the `Trainer` of a float64 tiny GPT on a ("dp", "cp") mesh and checks on every rank, against a plain single-
process model on the same global batch: the loss of a step (token-weighted over the global batch) and the full
gradient of every parameter (FSDP2's shards gathered). Its training losses over a few steps are compared in the test
process with a single-process `Trainer` reading the same global batches (at dp=1 the parameters stay whole: no
FSDP2, gradients all-reduced over the cp ranks). A sharded checkpoint written at dp=2 (world 2) is resumed in one
process and at dp2 x cp2, dp4 and dp1 x cp4 (world 4), one written at cp=2 in one process, each continuing to the
losses of the uninterrupted run. Bad inputs (ranks with different num_layers or seeds, a world size other than dp *
cp, a length or head count the cp size cannot split, a rank that never arrives) must raise on every rank within a
deadline.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import shutil
import tempfile
import time
import traceback
from pathlib import Path

import pytest
import torch

from tests.distributed.spawn import spawn_world

pytestmark = pytest.mark.distributed

WORLD_TIMEOUT_S = 140
STEPS = 4
MBS = 2  # sequences per dp rank
BASE = dict(
    preset="tiny", num_keys=16, num_values=16, eval_iters=0, quiet=True, save=None, train_iters=STEPS,
    micro_batch_size=MBS, lr=1e-2, lr_warmup_iters=1, clip_grad=0.5,
)  # fmt: skip
MODEL = {"attention_backend": "tiled"}

# (name, data_parallel, context_parallel) of the valid cases per world
MESHES = {
    2: [("dp2cp1", 2, 1), ("dp1cp2", 1, 2), ("dp1cp2-offload", 1, 2), ("dp2cp1-replicate", 2, 1)],
    4: [
        ("dp2cp2", 2, 2),
        ("dp4cp1", 4, 1),
        ("dp1cp4-ulysses_ring", 1, 4),
        ("dp2cp2-offload", 2, 2),
        ("dp2cp2-offload-resident", 2, 2),
        ("dp2cp2-replicate", 2, 2),
    ],
}
# extra settings of a mesh case, by name (offload: the states in host memory, sharded over dp x cp; replicate: whole
# parameters on every rank, the gradients all-reduced over dp x cp)
MESH_KW = {
    "dp1cp4-ulysses_ring": {"cp_method": "ulysses_ring", "cp_ulysses_size": 2},
    "dp1cp2-offload": {"offload_params": True},
    "dp2cp2-offload": {"offload_params": True},
    # the output layer and the first layer's states kept out of the offload (tied tiny model), sharded over the 4
    "dp2cp2-offload-resident": {"offload_params": True, "offload_resident_units": 2},
    "dp2cp1-replicate": {"dp_shard": "replicate"},
    "dp2cp2-replicate": {"dp_shard": "replicate"},
}
BAD = {
    2: ["bad-num-layers", "bad-seed", "bad-world-size", "bad-seq-length", "bad-rank-absent"],
    4: ["bad-ulysses-heads"],
}
# the dp=2 checkpoint resumed on 4 ranks (dp1cp4: whole parameters on every rank, loaded from FSDP2's shards)
RESUMES = {4: [("resume-dp2cp2", 2, 2), ("resume-dp4cp1", 4, 1), ("resume-dp1cp4", 1, 4)]}


def _cfg(**kw):
    from longctx.training.config import TrainConfig

    model = {**MODEL, **kw.pop("model", {})}
    return TrainConfig(**{**BASE, **kw}, model=model)


# ---------------------------------------------------------------------------------------------------------
# the cases (run on every rank)
# ---------------------------------------------------------------------------------------------------------


def _oracle_case(dp: int, cp: int, **kw) -> dict:
    """One step's loss and full gradients against a plain model on the global batch; then STEPS steps' losses."""
    from longctx.models.gpt import GPT
    from longctx.training.trainer import Trainer

    trainer = Trainer(_cfg(data_parallel=dp, context_parallel=cp, **kw))
    torch.manual_seed(trainer.cfg.seed)
    ref = GPT(trainer.model_config)  # the same initial weights as the trainer's (same seed, same order)
    batch = trainer.task.batch(MBS * dp, 0, trainer.cfg.seed, "train")
    ref_loss = ref(batch.inputs, labels=batch.labels, loss_mask=batch.loss_mask)
    ref_loss.backward()
    loss = trainer.forward_backward(batch)
    grad_err = 0.0
    for (name, p), (ref_name, q) in zip(trainer.model.named_parameters(), ref.named_parameters(), strict=True):
        assert name == ref_name, (name, ref_name)
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        grad_err = max(grad_err, float((g - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-30)))
    trainer.optimizer.zero_grad(set_to_none=True)
    result = trainer.train()
    return {
        "loss": float(loss),
        "ref_loss": float(ref_loss.detach()),
        "grad_rel_err": grad_err,
        "losses": result.losses,
        "strategy": trainer.dp_strategy,
    }


def _save_case(shared: str, dp: int = 2, cp: int = 1, folder: str = "run") -> dict:
    """dp x cp stops after 2 of STEPS steps with a sharded checkpoint in <shared>/<folder> (dp=2: FSDP2's shards;
    dp=1: whole parameters, as context parallelism alone runs)."""
    from longctx.training.trainer import Trainer

    trainer = Trainer(
        _cfg(data_parallel=dp, context_parallel=cp, micro_batch_size=2 * MBS // dp, halt_after=2,
             save=os.path.join(shared, folder))
    )  # fmt: skip
    return {"losses": trainer.train().losses, "strategy": trainer.dp_strategy}


def _resume_case(shared: str, dp: int, cp: int) -> dict:
    from longctx.training.trainer import Trainer

    run = Path(shared) / "run"
    trainer = Trainer(
        _cfg(data_parallel=dp, context_parallel=cp, micro_batch_size=2 * MBS // dp, resume=str(run / "checkpoint"))
    )
    return {"start": trainer.start_step, "losses": trainer.train().losses}


def _bad_case(name: str, rank: int, world: int) -> dict:
    """Build a Trainer that must fail on every rank; returns the error and the seconds it took."""
    import longctx.distributed.model as dm
    from longctx.training.trainer import Trainer

    kw: dict = {"data_parallel": world}
    if name == "bad-num-layers" and rank == 1:
        kw["model"] = {"num_layers": 3}
    elif name == "bad-seed" and rank == 1:
        kw["seed"] = 7
    elif name == "bad-world-size":
        kw = {"data_parallel": 2, "context_parallel": 2}
    elif name == "bad-seq-length":
        kw = {"context_parallel": 2, "model": {"seq_length": 66}}  # zigzag needs a multiple of 2 * cp
    elif name == "bad-ulysses-heads":
        kw = {"context_parallel": 4, "cp_method": "ulysses", "model": {"num_attention_heads": 2, "kv_channels": 32}}
    elif name == "bad-rank-absent":
        dm.AGREEMENT_TIMEOUT_S = 5.0
        if rank == 1:  # never reaches the start-up check
            time.sleep(12)
            return {"skipped": True}
    t0 = time.monotonic()
    try:
        Trainer(_cfg(**kw))
    except (ValueError, TypeError) as e:
        return {"error": str(e), "type": type(e).__name__, "seconds": time.monotonic() - t0}
    return {"error": None, "seconds": time.monotonic() - t0}


def _cases(world: int) -> list[str]:
    names = [name for name, _, _ in MESHES[world]]
    if world == 2:
        names += ["save-dp2", "save-cp2"]
    names += [name for name, _, _ in RESUMES.get(world, [])]
    return names + BAD[world]  # bad-rank-absent last: it leaves the world unusable


def _worker(rank: int, world: int, store_path: str, out_dir: str, shared: str = "") -> None:
    import torch.distributed as dist

    torch.set_default_dtype(torch.float64)
    os.environ["OMP_NUM_THREADS"] = "1"  # the trainer then leaves torch's thread count alone
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    meshes = {name: (dp, cp) for name, dp, cp in MESHES[world]}
    resumes = {name: (dp, cp) for name, dp, cp in RESUMES.get(world, [])}
    results: dict = {}
    for name in _cases(world):
        try:
            if name in meshes:
                results[name] = _oracle_case(*meshes[name], **MESH_KW.get(name, {}))
            elif name == "save-dp2":
                results[name] = _save_case(shared)
            elif name == "save-cp2":
                results[name] = _save_case(shared, dp=1, cp=2, folder="run_cp2")
            elif name in resumes:
                results[name] = _resume_case(shared, *resumes[name])
            else:
                results[name] = _bad_case(name, rank, world)
        except Exception:
            results[name] = {"crash": traceback.format_exc()[-3000:]}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
    if dist.is_initialized() and not results.get("bad-rank-absent", {}).get("skipped"):
        dist.destroy_process_group()


@functools.cache
def _shared() -> str:
    return tempfile.mkdtemp(prefix="longctx-dp-")


@functools.cache
def _world(world: int) -> tuple[list[dict], list[int]]:
    if world == 4:
        _world(2)  # the checkpoint that world 4 resumes
    return spawn_world(functools.partial(_worker, shared=_shared()), world, WORLD_TIMEOUT_S)


@functools.cache
def _single_losses(global_batch: int) -> list[float]:
    """The losses of STEPS steps of a single-process float64 Trainer reading ``global_batch`` sequences a step."""
    from longctx.training.trainer import Trainer

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return Trainer(_cfg(micro_batch_size=global_batch)).train().losses
    finally:
        torch.set_default_dtype(previous)


@pytest.fixture(scope="module", autouse=True)
def _cleanup():
    yield
    shutil.rmtree(_shared(), ignore_errors=True)


def _result(world: int, name: str, rank: int) -> dict:
    per_rank, hung = _world(world)
    assert rank not in hung or name == "bad-rank-absent", f"rank {rank} of world {world} hung"
    res = per_rank[rank].get(name)
    assert res is not None, f"rank {rank} never finished {name}"
    assert "crash" not in res, res["crash"]
    return res


# ---------------------------------------------------------------------------------------------------------
# the tests
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world, name, dp", [(w, n, dp) for w, ms in MESHES.items() for n, dp, _ in ms])
def test_mesh_step_matches_a_single_process_on_the_global_batch(world, name, dp):
    single = _single_losses(MBS * dp)
    for rank in range(world):
        res = _result(world, name, rank)
        # one data-parallel rank shards nothing: whole parameters, gradients all-reduced over the cp ranks
        whole = dp == 1 or name.endswith("replicate")
        expected = "fsdp2-offload" if "offload" in name else "allreduce" if whole else "fsdp2"
        assert res["strategy"] == expected
        assert res["loss"] == pytest.approx(res["ref_loss"], rel=1e-12)
        assert res["grad_rel_err"] < 1e-10, res["grad_rel_err"]
        assert res["losses"] == pytest.approx(single, rel=1e-9), (res["losses"], single)


@pytest.mark.parametrize(
    ("name", "folder", "strategy"), [("save-dp2", "run", "fsdp2"), ("save-cp2", "run_cp2", "allreduce")]
)
def test_sharded_checkpoint_resumes_in_one_process(name, folder, strategy):
    from longctx.training.trainer import Trainer

    for rank in range(2):
        res = _result(2, name, rank)
        assert res["strategy"] == strategy
        assert res["losses"] == pytest.approx(_single_losses(2 * MBS)[:2], rel=1e-9)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        ckpt = Path(_shared()) / folder / "checkpoint"
        assert [p.name for p in ckpt.iterdir()] == ["step-00000002"]
        trainer = Trainer(_cfg(micro_batch_size=2 * MBS, resume=str(ckpt)))
        assert trainer.start_step == 2
        losses = trainer.train().losses
    finally:
        torch.set_default_dtype(previous)
    assert losses == pytest.approx(_single_losses(2 * MBS)[2:], rel=1e-9)


@pytest.mark.parametrize("name", [n for n, _, _ in RESUMES[4]])
def test_sharded_checkpoint_of_dp2_resumes_on_four_ranks(name):
    for rank in range(4):
        res = _result(4, name, rank)
        assert res["start"] == 2
        assert res["losses"] == pytest.approx(_single_losses(2 * MBS)[2:], rel=1e-9)


BAD_MESSAGES = {
    "bad-num-layers": "num_layers: rank 0 has 2, rank 1 has 3",
    "bad-seed": "seed: rank 0 has 1234, rank 1 has 7",
    "bad-world-size": "--data-parallel 2 x --context-parallel 2 needs 4 processes, got world size 2",
    "bad-seq-length": "context-parallel sequence length 66",
    "bad-ulysses-heads": "number of query heads (2) divisible by the context-parallel size (4)",
    "bad-rank-absent": "did not complete within 5 s",
}


@pytest.mark.parametrize("world, name", [(w, n) for w, names in BAD.items() for n in names])
def test_bad_input_raises_on_every_rank_without_a_hang(world, name):
    ranks = [0] if name == "bad-rank-absent" else range(world)  # the absent rank raises nothing
    for rank in ranks:
        res = _result(world, name, rank)
        assert res["error"] is not None, f"rank {rank} did not raise"
        assert res["type"] == "ValueError"
        assert BAD_MESSAGES[name] in res["error"], res["error"]
        assert res["seconds"] < 30
