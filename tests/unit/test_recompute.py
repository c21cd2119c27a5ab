"""Activation recomputation, tested by counting: gradients, FLOPs and bytes saved for backward."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import longctx
from longctx.layers import recompute
from longctx.layers.recompute import Chunk, plan_layers, run_layers, validate_recompute
from longctx.models.gpt import GPT, GPTConfig, lm_loss

B, S = 2, 32

SETTINGS = {
    "none": (None, None, None),
    "selective": ("selective", None, None),
    "full-uniform-1": ("full", "uniform", 1),
    "full-uniform-2": ("full", "uniform", 2),
    "full-uniform-3": ("full", "uniform", 3),
    "full-block-1": ("full", "block", 1),
    "full-block-3": ("full", "block", 3),
}


def make(setting: str, backend: str = "math", num_layers: int = 3, **kw) -> GPT:
    g, m, n = SETTINGS[setting]
    cfg = GPTConfig.preset(
        "tiny",
        num_layers=num_layers,
        seq_length=S,
        attention_backend=backend,
        recompute_granularity=g,
        recompute_method=m,
        recompute_num_layers=n,
        **kw,
    )
    torch.manual_seed(0)
    return GPT(cfg)


def batch(vocab: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, vocab, (B, S + 1), generator=g)
    return x[:, :-1], x[:, 1:]


# -- plans and validation -----------------------------------------------------------------------------------


def test_plans():
    assert plan_layers(None, None, None, 3) == [Chunk(0, 1, False), Chunk(1, 2, False), Chunk(2, 3, False)]
    assert plan_layers("selective", None, None, 2) == [Chunk(0, 1, False), Chunk(1, 2, False)]
    assert plan_layers("full", "uniform", 2, 5) == [Chunk(0, 2, True), Chunk(2, 4, True), Chunk(4, 5, True)]
    assert plan_layers("full", "uniform", 5, 5) == [Chunk(0, 5, True)]
    block = [Chunk(0, 1, True), Chunk(1, 2, True), Chunk(2, 3, False), Chunk(3, 4, False)]
    assert plan_layers("full", "block", 2, 4) == block


@pytest.mark.parametrize(
    "g, m, n, match",
    [
        ("full", None, 2, "needs recompute_method"),
        ("full", "uniform", None, "needs recompute_num_layers"),
        ("full", "uniform", 0, r"in \[1, num_layers=4\]"),
        ("full", "block", 5, r"in \[1, num_layers=4\]"),
        ("selective", "uniform", None, "must be None"),
        ("selective", None, 2, "must be None"),
        (None, "block", 2, "only meaningful"),
        ("partial", None, None, "must be one of"),
        ("full", "chunked", 1, "'uniform' or 'block'"),
    ],
)
def test_validation(g, m, n, match):
    with pytest.raises(ValueError, match=match):
        validate_recompute(g, m, n, 4)
    with pytest.raises(ValueError, match=match):
        GPTConfig.preset("tiny", num_layers=4, recompute_granularity=g, recompute_method=m, recompute_num_layers=n)


# -- gradients: bitwise equal to no recomputation, dropout included ---------------------------------------------


def grads(model: GPT, dropout_seed: int = 7) -> dict[str, torch.Tensor]:
    x, y = batch()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(dropout_seed)
    lm_loss(model(x), y).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("setting", [s for s in SETTINGS if s != "none"])
def test_gradients_bitwise_equal_with_dropout(setting):
    kw = dict(hidden_dropout=0.1, attention_dropout=0.1)
    ref = grads(make("none", **kw))
    got = grads(make(setting, **kw))
    for name in ref:
        assert torch.equal(ref[name], got[name]), f"{setting}: gradient of {name} differs"


def test_gradients_equal_without_dropout_any_backend():
    # "auto" (tiled or math on CPU): recomputation must not change the numbers either
    ref = grads(make("none", backend="auto"))
    for setting in ("selective", "full-uniform-1", "full-block-1"):
        got = grads(make(setting, backend="auto"))
        for name in ref:
            assert torch.equal(ref[name], got[name]), f"{setting}: {name}"


# -- never in eval or under no_grad -------------------------------------------------------------------------


def test_no_checkpoint_in_eval_or_no_grad(monkeypatch):
    calls = []
    real = recompute.checkpoint

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(recompute, "checkpoint", counting)
    x, _ = batch()
    for setting in ("selective", "full-uniform-1", "full-block-1"):
        model = make(setting)
        with torch.no_grad():
            model(x)
        model.eval()
        model(x)
        assert calls == [], setting
        model.train()
        model(x)
        assert calls, setting
        calls.clear()


# -- FLOPs: full recomputation of N layers adds exactly one forward of those N layers ----------------------------


def flops(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def train_step_flops(model: GPT) -> int:
    x, y = batch()
    return flops(lambda: lm_loss(model(x), y).backward())


def one_layer_forward_flops(model: GPT) -> int:
    c = model.config
    h = torch.randn(B, S, c.hidden_size)
    cos, sin = model.rotary(torch.arange(S))
    return flops(lambda: model.layers[0](h, cos, sin))


@pytest.mark.parametrize(
    "setting, recomputed_layers, chunks",
    [
        ("full-uniform-1", 3, 3),
        ("full-uniform-2", 3, 2),
        ("full-uniform-3", 3, 1),
        ("full-block-1", 1, 1),
        ("full-block-3", 3, 3),
    ],
)
def test_full_recompute_adds_one_forward_of_the_recomputed_layers(setting, recomputed_layers, chunks):
    # Exactly one extra forward of each recomputed layer, except that non-reentrant checkpointing stops
    # recomputing a chunk once backward has every tensor it needs: the chunk's last matmul (linear_fc2 of its
    # last layer, whose output nobody saves) is not redone. Nothing else is added.
    base = train_step_flops(make("none"))
    model = make(setting)
    c = model.config
    layer = one_layer_forward_flops(model)
    fc2 = 2 * B * S * c.ffn_size * c.hidden_size
    assert layer > 0
    assert train_step_flops(model) - base == recomputed_layers * layer - chunks * fc2


def test_full_recompute_without_early_stop_is_exactly_one_forward():
    base = train_step_flops(make("none"))
    model = make("full-uniform-1")
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        assert train_step_flops(model) - base == 3 * one_layer_forward_flops(model)


def test_selective_recomputes_only_core_attention_with_math():
    # Unfused attention: the core attention of every layer (q k^T, softmax, p v) is recomputed. Early stop
    # (as above) skips its last matmul, p v, whose output backward does not need: q k^T, 2 B Hq S S D per layer,
    # is the only extra work. Without early stop it is both matmuls.
    base = train_step_flops(make("none"))
    model = make("selective")
    c = model.config
    qk = 2 * B * c.num_attention_heads * S * S * c.head_dim
    assert train_step_flops(model) - base == c.num_layers * qk
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        assert train_step_flops(model) - base == c.num_layers * 2 * qk


class FlashLike(torch.autograd.Function):
    """Saves only q, k, v, out, lse and recomputes the scores in backward, as a flash kernel does."""

    @staticmethod
    def forward(ctx, q, k, v):
        from longctx.masks import Band
        from longctx.reference.naive import naive_attention

        out, lse = naive_attention(q, k, v, scale=q.shape[-1] ** -0.5, band=Band.from_args(S, S, causal=True))
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, _, _ = ctx.saved_tensors
        with torch.enable_grad():
            q_, k_, v_ = (t.detach().requires_grad_() for t in (q, k, v))
            out = longctx.attention(q_, k_, v_, causal=True, backend="math")
            return torch.autograd.grad(out, (q_, k_, v_), do)


def flash_like(q, k, v):
    return FlashLike.apply(q, k, v)


def test_selective_adds_nothing_with_a_fused_core_attention():
    a, b = make("none"), make("selective")
    a.set_core_attention(flash_like)
    b.set_core_attention(flash_like)
    assert train_step_flops(b) == train_step_flops(a)
    ga, gb = grads(a), grads(b)
    assert all(torch.equal(ga[n], gb[n]) for n in ga)


def test_selective_adds_nothing_with_the_tiled_backend():
    assert train_step_flops(make("selective", backend="tiled")) == train_step_flops(make("none", backend="tiled"))


# -- bytes saved for backward -------------------------------------------------------------------------------


def saved_bytes(fn, exclude: list[torch.Tensor]) -> int:
    """Bytes of distinct storages saved for backward while fn runs (parameters excluded)."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(seen.values())


def layers_saved_bytes(model: GPT) -> tuple[int, int, int]:
    c = model.config
    x = torch.randn(B, S, c.hidden_size, requires_grad=True)
    cos, sin = model.rotary(torch.arange(S))
    n = saved_bytes(lambda: run_layers(model.layers, x, model._chunks, cos, sin), list(model.parameters()))
    return n, x.numel() * x.element_size(), cos.nbytes + sin.nbytes


@pytest.mark.parametrize("setting, chunks", [("full-uniform-1", 3), ("full-uniform-3", 1), ("full-uniform-2", 2)])
def test_full_keeps_one_hidden_state_per_chunk(setting, chunks):
    n, hidden, rope = layers_saved_bytes(make(setting))
    assert n == chunks * hidden + rope


def test_saved_bytes_none_vs_block_vs_selective():
    none, hidden, rope = layers_saved_bytes(make("none"))
    per_layer = (none - rope) / 3
    assert per_layer > 10 * hidden  # an unfused layer keeps many hidden-sized tensors and the S x S scores
    block1, _, _ = layers_saved_bytes(make("full-block-1"))
    assert block1 == none - per_layer + hidden  # layer 0 keeps only its input; layers 1, 2 keep everything
    selective, _, _ = layers_saved_bytes(make("selective"))
    c = make("none").config
    scores = B * c.num_attention_heads * S * S * 4  # float32 probabilities of the math backend
    assert selective < none - 3 * scores  # at least the S x S tensor of every layer is gone
