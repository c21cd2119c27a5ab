"""Context parallelism for transformers models (`longctx.integrations.transformers.apply(...,
context_parallel_group=...)`) in gloo processes, against the same model in one process.

One world of 2 processes is spawned (a FileStore in a temporary directory) and runs every case; each case is then
reported as its own test. Every rank builds the same tiny model from one seed and calls it with the same full
batch; the loss value must equal the single-process loss and the gradients, summed over the ranks by
`allreduce_gradients`, the single-process gradients (under PEFT's LoRA adapters: the adapters' gradients, the only
ones). Packed batches (DataCollatorWithFlattening, with cu_seq_lens or
with restarting position ids only) are dealt by the dispatcher and compared with the same packed batch in one
process.
"""

from __future__ import annotations

from functools import cache

import pytest
import torch

from tests.distributed.spawn import assert_ranks_ok, run_case_world

pytest.importorskip("transformers")

pytestmark = pytest.mark.distributed

WORLD = 2
WORLD_TIMEOUT_S = 240
V = 89

CASES = (
    "llama-ring-zigzag",
    "mistral-window-allgather-contiguous",
    "qwen2-ulysses-zigzag",
    "llama-ring-recompute-logits-loss",
    "llama-num-items-in-batch",
    "llama-packed-collator-ring",
    "llama-packed-positions-allgather",
    "qwen2-packed-collator-ulysses-recompute",
    "llama-lora-ring-zigzag-recompute",
    "llama-lora-packed-collator-ulysses",
    "llama-packed-collator-auto",
    "bad-padding",
    "bad-packed-window",
)


def _model(family: str, lora: bool = False):
    """The family's tiny model; with ``lora``, under PEFT's LoRA adapters on every linear of its layers (only they
    train; B starts non-zero so that every adapter gradient is exercised)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

    small = dict(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
    )  # fmt: skip
    cfg = {
        "llama": lambda: LlamaConfig(**small),
        "mistral": lambda: MistralConfig(**small, sliding_window=5),
        "qwen2": lambda: Qwen2Config(**small),
    }[family]()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="longctx").float()
    if lora:
        from tests.lora import with_lora

        model = with_lora(model)
    return model


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _close(got, ref, what: str) -> None:
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=2e-6, msg=lambda m: f"{what}: {m}")


def _run_case(name: str, rank: int, world: int) -> None:
    import torch.distributed as dist

    import longctx.integrations.transformers as lt

    family = name.split("-")[0] if not name.startswith("bad") else "mistral" if "window" in name else "llama"
    method = next((m for m in ("ring", "allgather", "ulysses", "auto") if m in name), "ring")
    layout = "contiguous" if "contiguous" in name else "zigzag"
    x = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(1))  # the same on every rank
    labels = x.clone()
    labels[1, :3] = -100
    kw = {}
    if "recompute" in name:
        kw = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1, fused_loss=False)
    lora = "lora" in name
    model = lt.apply(
        _model(family, lora), context_parallel_group=dist.group.WORLD, context_parallel_method=method,
        context_parallel_layout=layout, **kw,
    )  # fmt: skip
    if name == "bad-padding":
        mask = torch.ones_like(x)
        mask[0, -2:] = 0
        try:
            model(input_ids=x, attention_mask=mask, labels=labels)
        except ValueError as e:
            assert "padding" in str(e), e
            return
        raise AssertionError("padding under context parallelism did not raise")
    if method == "auto":  # 4 query / 2 kv heads split over 2 ranks: Ulysses
        assert model._longctx_context_parallel.method == "ulysses", model._longctx_context_parallel.method
    if "packed" in name:
        _packed_case(name, model, family, kw, lora)
        return

    single = _model(family, lora)
    extra = {"num_items_in_batch": torch.tensor(37)} if "num-items" in name else {}
    ref = single(input_ids=x, labels=labels, **extra).loss
    ref.backward()
    out = model(input_ids=x, labels=labels, **extra)
    _same_step(model, out.loss, single, ref)
    # without labels: this rank's logits, the matching part of the single-process logits
    with torch.no_grad():
        local = model(input_ids=x).logits
        full = single(input_ids=x).logits
    from longctx.distributed import shard

    _close(local, shard(full, 1, None, layout), "logits")


def _packed_batch(flash_kwargs: bool) -> dict:
    from transformers import DataCollatorWithFlattening

    g = torch.Generator().manual_seed(3)
    docs = [{"input_ids": torch.randint(0, V, (n,), generator=g).tolist()} for n in (9, 5, 13, 1, 7, 11)]  # 46
    batch = dict(DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)(docs))
    return {k: v for k, v in batch.items() if k != "attention_mask"}


def _packed_case(name: str, model, family: str, kw: dict, lora: bool = False) -> None:
    batch = _packed_batch(flash_kwargs="collator" in name)
    if name == "bad-packed-window":
        try:
            model(**batch)
        except ValueError as e:
            assert "sliding window" in str(e), e
            return
        raise AssertionError("packed documents with a sliding window under context parallelism did not raise")
    single = _model(family, lora)
    ref = single(**batch, use_cache=False).loss  # the same packed batch in one process (varlen)
    ref.backward()
    out = model(**batch)
    plan = model._longctx_context_parallel._packed_plan  # the dispatcher's plan of this batch ran the attention
    assert plan is not None and plan.total == 46 and plan.local_len == 23, plan
    _same_step(model, out.loss, single, ref)


def _same_step(model, loss, single, ref) -> None:
    """The context-parallel loss equals the single-process one, and after its backward and `allreduce_gradients`
    every gradient equals the single process's (``ref`` already differentiated)."""
    import longctx.integrations.transformers as lt

    loss.backward()
    lt.allreduce_gradients(model)
    _close(loss.detach(), ref.detach(), "loss")
    ref_g, got_g = _grads(single), _grads(model)
    assert ref_g.keys() == got_g.keys() and ref_g
    if any("lora_" in n for n in ref_g):  # under PEFT only the adapters train
        assert all("lora_" in n for n in got_g), sorted(got_g)
    for n in ref_g:
        _close(got_g[n], ref_g[n], n)


def case_names(world: int) -> list[str]:
    """The cases every rank runs (`tests.distributed.spawn.run_case_world`), the same at any world size."""
    return list(CASES)


@cache
def run_world() -> dict[str, list[str]]:
    return run_case_world(__name__, WORLD, WORLD_TIMEOUT_S)


@pytest.mark.parametrize("name", CASES)
def test_transformers_cp_gloo(name: str) -> None:
    assert_ranks_ok(run_world()[name])
