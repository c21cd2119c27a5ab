"""Packed-document training (`longctx train --doc-separator`) in one process and under context parallelism (gloo).

In one process, a float64 tiny GPT with `DocumentAttention` and document-local positions must give the loss and
gradients of running every document on its own (the mask isolates documents, RoPE restarts). Worlds of 2 and 4
spawned processes then check, on every rank, that `DocumentParallel` (the dispatcher's plan per batch, every
method) gives the single-process loss and summed gradients, that `Trainer` with ``doc_separator`` under
dp x cp gives the single-process step, and that bad input raises on every rank. `longctx train --doc-separator`
runs end to end under torchrun at cp=2 with the losses of one process.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import random
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import pytest
import torch

from tests.distributed.spawn import spawn_world

pytestmark = pytest.mark.distributed

WORLD_TIMEOUT_S = 120
SEP = r"\n\n"
MBS = 2
STEPS = 2
S = 24  # tokens per row of the library cases
METHODS = {2: ("ring", "allgather", "ulysses", "p2p"), 4: ("ring", "ulysses", "ulysses_ring", "p2p")}
MESHES = {2: [("dp1cp2", 1, 2)], 4: [("dp2cp2", 2, 2), ("dp1cp4", 1, 4)]}
BAD = ("bad-rows-differ", "bad-not-divisible", "bad-empty-separator")


def _model_config():
    from longctx.models.gpt import GPTConfig

    return GPTConfig(
        vocab_size=64, seq_length=S, num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
        ffn_hidden_size=64, attention_backend="tiled",
    )  # fmt: skip


def _doc_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(inputs, labels, loss_mask, doc_starts), each (2, S): documents of length 1, 2, one longer than a shard."""
    g = torch.Generator().manual_seed(5)
    inputs = torch.randint(0, 64, (2, S), generator=g)
    labels = torch.randint(0, 64, (2, S), generator=g)
    starts = torch.zeros(2, S, dtype=torch.bool)
    starts[0, [0, 1, 2, 4, 21]] = True  # lengths 1, 1, 2, 17, 3
    starts[1, [0, S - 1]] = True  # a document of S - 1 tokens, then one of 1
    mask = torch.rand(2, S, generator=g) > 0.2
    return inputs, labels, mask, starts


def _single_process(model, inputs, labels, mask, starts) -> torch.Tensor:
    """The mean loss of the batch with the document attention in one process (backward run)."""
    from longctx.layers.attention import DocumentAttention
    from longctx.training.data import document_positions, packed_cu_seqlens

    attn = DocumentAttention("tiled")
    attn.set_documents(packed_cu_seqlens(starts))
    model.set_core_attention(attn)
    loss = model(inputs, position_ids=document_positions(starts), labels=labels, loss_mask=mask)
    loss.backward()
    return loss.detach()


def _grads(model) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


# ---------------------------------------------------------------------------------------------------------
# one process: documents isolated
# ---------------------------------------------------------------------------------------------------------


def test_single_process_documents_equal_each_document_run_alone():
    from longctx.models.gpt import GPT

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = GPT(_model_config())
        inputs, labels, mask, starts = _doc_batch()
        loss = _single_process(model, inputs, labels, mask, starts)
        got = _grads(model)

        model.zero_grad(set_to_none=True)
        model.set_core_attention(None)  # plain causal attention, one document at a time, positions from 0
        total = torch.zeros((), dtype=torch.float64)
        for b in range(2):
            bounds = starts[b].nonzero().flatten().tolist() + [S]
            for lo, hi in zip(bounds[:-1], bounds[1:]):
                sl = slice(lo, hi)
                total = total + model(
                    inputs[b : b + 1, sl], labels=labels[b : b + 1, sl], loss_mask=mask[b : b + 1, sl], reduction="sum"
                )
        ref = total / mask.sum()
        ref.backward()
    finally:
        torch.set_default_dtype(previous)
    assert float(loss) == pytest.approx(float(ref.detach()), rel=1e-12)
    for g, p in zip(got, model.parameters(), strict=True):
        assert _rel(g, p.grad) < 1e-10


def test_documents_change_the_result():
    """The document mask is not a no-op: plain causal attention over the same rows gives another loss."""
    from longctx.models.gpt import GPT

    torch.manual_seed(0)
    model = GPT(_model_config()).double()
    inputs, labels, mask, starts = _doc_batch()
    with_docs = _single_process(model, inputs, labels, mask, starts)
    model.set_core_attention(None)
    plain = model(inputs, labels=labels, loss_mask=mask).detach()
    assert abs(float(with_docs) - float(plain)) > 1e-6


# ---------------------------------------------------------------------------------------------------------
# spawned worlds
# ---------------------------------------------------------------------------------------------------------


def _write_text(path: Path) -> None:
    """Documents of 1 to 150 bytes separated by blank lines (some longer than a row of the tiny preset)."""
    rng = random.Random(3)
    docs = []
    while sum(len(d) + 2 for d in docs) < 6000:
        n = rng.choice([1, 2, 5, 20, 40, 90, 150])
        docs.append("".join(rng.choice("abcdefgh ij\n") for _ in range(n)).replace("\n\n", "\n"))
    path.write_text("\n\n".join(docs))


def _train_cfg(path: str, **kw):
    from longctx.training.config import TrainConfig

    base = dict(
        preset="tiny", data=path, doc_separator=SEP, eval_iters=1, quiet=True, save=None, train_iters=STEPS,
        micro_batch_size=MBS, lr=1e-2, lr_warmup_iters=1, clip_grad=0.5,
    )  # fmt: skip
    return TrainConfig(**{**base, **kw}, model={"attention_backend": "tiled"})


def _plan_case(method: str) -> dict:
    import torch.distributed as dist

    from longctx.distributed.documents import setup_document_parallel
    from longctx.distributed.mesh import share_of_mean
    from longctx.models.gpt import GPT

    inputs, labels, mask, starts = _doc_batch()
    torch.manual_seed(0)
    ref = GPT(_model_config())
    ref_loss = _single_process(ref, inputs, labels, mask, starts)
    torch.manual_seed(0)
    model = GPT(_model_config())
    cp = setup_document_parallel(model, method=method, ulysses_size=2 if method == "ulysses_ring" else None)
    x, y, m, pos = cp.shard_batch(inputs, labels, mask, starts)
    local_sum = model(x, position_ids=pos, labels=y, loss_mask=m, reduction="sum")
    loss, value = share_of_mean(local_sum, m.sum())
    loss.backward()
    err = 0.0
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        g = p.grad.clone()
        dist.all_reduce(g)
        err = max(err, _rel(g, q.grad))
    return {"loss": float(value), "ref_loss": float(ref_loss), "grad_rel_err": err, "balance": cp.plan.balance()}


def _trainer_case(path: str, dp: int, cp: int) -> dict:
    from longctx.models.gpt import GPT
    from longctx.training.trainer import Trainer

    trainer = Trainer(_train_cfg(path, data_parallel=dp, context_parallel=cp))
    torch.manual_seed(trainer.cfg.seed)
    ref = GPT(trainer.model_config)
    batch = trainer.task.batch(MBS * dp, 0, trainer.cfg.seed, "train")
    ref_loss = _single_process(ref, batch.inputs, batch.labels, batch.loss_mask, batch.doc_starts)
    loss = trainer.forward_backward(batch)
    err = 0.0
    for p, q in zip(trainer.model.parameters(), ref.parameters(), strict=True):
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        err = max(err, _rel(g, q.grad))
    trainer.optimizer.zero_grad(set_to_none=True)
    result = trainer.train()
    return {"loss": float(loss), "ref_loss": float(ref_loss), "grad_rel_err": err, "losses": result.losses}


def _bad_case(name: str, rank: int, path: str) -> dict:
    from longctx.distributed.documents import DocumentParallel
    from longctx.training.trainer import Trainer

    try:
        if name == "bad-empty-separator":
            Trainer(_train_cfg(path, doc_separator="", context_parallel=dist_world()))
        else:
            inputs, labels, mask, starts = _doc_batch()
            if name == "bad-rows-differ" and rank == 1:
                starts = starts.clone()
                starts[0, 10] = True
            if name == "bad-not-divisible":
                inputs, labels, mask, starts = (t[:1, :5] for t in (inputs, labels, mask, starts))
            DocumentParallel(method="ring").shard_batch(inputs, labels, mask, starts)
    except (ValueError, TypeError) as e:
        return {"error": str(e), "type": type(e).__name__}
    return {"error": None}


def dist_world() -> int:
    import torch.distributed as dist

    return dist.get_world_size()


def _cases(world: int) -> list[str]:
    return [f"plan-{m}" for m in METHODS[world]] + [n for n, _, _ in MESHES[world]] + list(BAD)


def _worker(rank: int, world: int, store_path: str, out_dir: str, text: str = "") -> None:
    import torch.distributed as dist

    torch.set_default_dtype(torch.float64)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    meshes = {name: (dp, cp) for name, dp, cp in MESHES[world]}
    results: dict = {}
    for name in _cases(world):
        try:
            if name.startswith("plan-"):
                results[name] = _plan_case(name[len("plan-") :])
            elif name in meshes:
                results[name] = _trainer_case(text, *meshes[name])
            else:
                results[name] = _bad_case(name, rank, text)
        except Exception:
            results[name] = {"crash": traceback.format_exc()[-3000:]}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


@functools.cache
def _text() -> str:
    path = Path(tempfile.mkdtemp(prefix="longctx-docs-")) / "docs.txt"
    _write_text(path)
    return str(path)


@functools.cache
def _world(world: int) -> tuple[list[dict], list[int]]:
    return spawn_world(functools.partial(_worker, text=_text()), world, WORLD_TIMEOUT_S)


def _result(world: int, name: str, rank: int) -> dict:
    per_rank, hung = _world(world)
    assert rank not in hung, f"rank {rank} of world {world} hung"
    res = per_rank[rank].get(name)
    assert res is not None, f"rank {rank} never finished {name}"
    assert "crash" not in res, res["crash"]
    return res


@functools.cache
def _single_losses(global_batch: int) -> list[float]:
    from longctx.training.trainer import Trainer

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return Trainer(_train_cfg(_text(), micro_batch_size=global_batch)).train().losses
    finally:
        torch.set_default_dtype(previous)


@pytest.mark.parametrize("world, method", [(w, m) for w, ms in METHODS.items() for m in ms])
def test_document_parallel_matches_one_process(world, method):
    for rank in range(world):
        res = _result(world, f"plan-{method}", rank)
        assert res["loss"] == pytest.approx(res["ref_loss"], rel=1e-12)
        assert res["grad_rel_err"] < 1e-10, res["grad_rel_err"]


@pytest.mark.parametrize("world, name, dp", [(w, n, dp) for w, ms in MESHES.items() for n, dp, _ in ms])
def test_trainer_with_documents_matches_one_process(world, name, dp):
    single = _single_losses(MBS * dp)
    for rank in range(world):
        res = _result(world, name, rank)
        assert res["loss"] == pytest.approx(res["ref_loss"], rel=1e-12)
        assert res["grad_rel_err"] < 1e-10, res["grad_rel_err"]
        assert res["losses"] == pytest.approx(single, rel=1e-9), (res["losses"], single)


BAD_MESSAGES = {
    "bad-rows-differ": "different cu_seqlens",
    "bad-not-divisible": "multiple of the context-parallel size",
    "bad-empty-separator": "doc_separator '' is empty",
}


@pytest.mark.parametrize("name", BAD)
def test_bad_input_raises_on_every_rank(name):
    for rank in range(2):
        res = _result(2, name, rank)
        assert res["error"] is not None, f"rank {rank} did not raise"
        assert res["type"] == "ValueError"
        assert BAD_MESSAGES[name] in res["error"], res["error"]


# ---------------------------------------------------------------------------------------------------------
# the command, end to end under torchrun
# ---------------------------------------------------------------------------------------------------------

CLI = ["--preset", "tiny", "--micro-batch-size", "2", "--train-iters", str(STEPS), "--eval-iters", "1", "--quiet",
       "--attention-backend", "tiled", "--doc-separator", SEP]  # fmt: skip


def _losses(save: Path) -> list[float]:
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows]


def test_longctx_train_documents_cp2_under_torchrun(tmp_path):
    from longctx.training.trainer import main

    text = _text()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "longctx", "train",
           "--data", text, *CLI, "--context-parallel", "2", "--save", str(tmp_path / "cp2")]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert main(["--data", text, *CLI, "--save", str(tmp_path / "one")]) == 0
    cp2, one = _losses(tmp_path / "cp2"), _losses(tmp_path / "one")
    assert len(cp2) == STEPS
    assert cp2 == pytest.approx(one, rel=1e-4), (cp2, one)
