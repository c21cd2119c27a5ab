"""The GPT: config validation, shapes, causality, GQA through longctx.attention, and the context-parallel seams."""

from __future__ import annotations

import pytest
import torch

import longctx
from longctx.models.gpt import GPT, GPTConfig, lm_loss


def tiny(**kw) -> GPTConfig:
    return GPTConfig.preset("tiny", attention_backend="math", **kw)


def tokens(cfg: GPTConfig, b: int = 2, s: int | None = None, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (b, s or cfg.seq_length), generator=g)


# -- config -------------------------------------------------------------------------------------------------


def test_num_query_groups_invalid_lists_valid_values():
    with pytest.raises(ValueError, match=r"num_query_groups=3.*\[1, 2, 4\]"):
        GPTConfig.preset("tiny", num_query_groups=3)
    with pytest.raises(ValueError, match=r"\[1, 2, 3, 4, 6, 12\]"):
        GPTConfig(num_attention_heads=12, num_query_groups=5)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="num_query_groups"):
            GPTConfig.preset("tiny", num_query_groups=bad)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(hidden_size=66), "not divisible by num_attention_heads"),
        (dict(num_layers=0), "num_layers must be a positive int"),
        (dict(hidden_dropout=1.0), "hidden_dropout"),
        (dict(attention_dropout=-0.1), "attention_dropout"),
        (dict(attention_backend="nope"), "not a registered backend"),
        (dict(kv_channels=15), "even"),
        (dict(recompute_granularity="full"), "recompute_method"),
    ],
)
def test_config_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig.preset("tiny", **kw)


def test_config_is_frozen_and_presets():
    cfg = GPTConfig.preset("tiny")
    with pytest.raises(AttributeError):
        cfg.num_layers = 3  # type: ignore[misc]
    assert cfg.replace(num_layers=3).num_layers == 3
    with pytest.raises(ValueError, match="unknown GPT preset"):
        GPTConfig.preset("gpt5")
    with torch.device("meta"):
        assert 300e6 < GPT(GPTConfig.preset("gpt2-medium")).num_parameters() < 400e6
        assert 300e6 < GPT(GPTConfig.preset("llama-350m")).num_parameters() < 400e6
        assert 100e6 < GPT(GPTConfig.preset("gpt2-small")).num_parameters() < 150e6
    assert longctx.GPTConfig is GPTConfig and longctx.GPT is GPT


# -- forward ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("groups", [None, 2, 1])
def test_forward_shape_and_gqa_passes_kv_unrepeated(groups):
    cfg = tiny(num_query_groups=groups)
    model = GPT(cfg)
    seen = []

    def spy(q, k, v):
        seen.append((tuple(q.shape), tuple(k.shape), tuple(v.shape)))
        return longctx.attention(q, k, v, causal=True, backend="math")

    model.set_core_attention(spy)
    x = tokens(cfg, b=2, s=17)
    logits = model(x)
    assert logits.shape == (2, 17, cfg.vocab_size) and logits.dtype == torch.float32
    hkv = cfg.num_attention_heads if groups is None else groups
    assert seen == [((2, 4, 17, 16), (2, hkv, 17, 16), (2, hkv, 17, 16))] * cfg.num_layers
    model.set_core_attention(None)  # back to longctx.attention: same result
    torch.testing.assert_close(model(x), logits, rtol=0, atol=0)


def test_causal_future_tokens_do_not_change_past_logits():
    cfg = tiny()
    model = GPT(cfg).eval()
    x = tokens(cfg)
    y = x.clone()
    y[:, 40:] = (y[:, 40:] + 1) % cfg.vocab_size
    with torch.no_grad():
        a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :40], b[:, :40], rtol=0, atol=0)
    assert not torch.allclose(a[:, 40:], b[:, 40:])


def test_auto_backend_matches_math():
    cfg = GPTConfig.preset("tiny", attention_backend="auto")
    model = GPT(cfg)
    x = tokens(cfg)
    auto = model(x)
    model.set_core_attention(lambda q, k, v: longctx.attention(q, k, v, causal=True, backend="math"))
    torch.testing.assert_close(auto, model(x), rtol=1e-4, atol=1e-5)


def test_position_ids_are_relative_under_rope_and_per_batch():
    # RoPE is relative: shifting every position leaves the logits unchanged (up to rounding). This is what lets a
    # context-parallel rank pass the global positions of its shard.
    cfg = tiny()
    model = GPT(cfg).eval()
    x = tokens(cfg)
    with torch.no_grad():
        base = model(x)
        explicit = model(x, position_ids=torch.arange(cfg.seq_length))
        shifted = model(x, position_ids=torch.arange(cfg.seq_length) + 1000)
        per_batch = model(x, position_ids=torch.arange(cfg.seq_length).expand(2, -1))
    torch.testing.assert_close(explicit, base, rtol=0, atol=0)
    torch.testing.assert_close(per_batch, base, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(shifted, base, rtol=1e-3, atol=1e-3)
    with pytest.raises(ValueError, match="position_ids"):
        model(x, position_ids=torch.arange(5))


def test_positions_matter():
    cfg = tiny()
    model = GPT(cfg).eval()
    x = tokens(cfg)
    perm = torch.randperm(cfg.seq_length, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert not torch.allclose(model(x), model(x, position_ids=perm), atol=1e-3)


def test_tied_and_untied_embeddings():
    tied = GPT(tiny())
    untied = GPT(tiny(share_embeddings_and_output_weights=False))
    assert tied.output_layer is None and untied.output_layer is not None
    assert untied.num_parameters() - tied.num_parameters() == 128 * 64


def test_bad_tokens():
    model = GPT(tiny())
    with pytest.raises(ValueError, match="integer tensor of shape"):
        model(torch.randn(2, 8))
    with pytest.raises(ValueError, match="integer tensor of shape"):
        model(torch.zeros(8, dtype=torch.long))


def test_backward_reaches_every_parameter():
    cfg = tiny(hidden_dropout=0.1, attention_dropout=0.1)
    model = GPT(cfg)
    x = tokens(cfg)
    lm_loss(model(x), torch.roll(x, -1, 1)).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_lm_loss_mean_sum_and_mask():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, generator=g)
    labels = torch.randint(0, 7, (2, 5), generator=g)
    mask = torch.tensor([[1, 0, 1, 0, 0], [0, 0, 0, 1, 1]], dtype=torch.bool)
    per = torch.nn.functional.cross_entropy(logits.reshape(10, 7), labels.reshape(10), reduction="none")
    torch.testing.assert_close(lm_loss(logits, labels), per.mean())
    torch.testing.assert_close(lm_loss(logits, labels, mask), per[mask.reshape(10)].mean())
    torch.testing.assert_close(lm_loss(logits, labels, mask, reduction="sum"), per[mask.reshape(10)].sum())
    # local sums over shards add up to the global sum: the context-parallel loss
    parts = [lm_loss(logits[:, i : i + 2], labels[:, i : i + 2], mask[:, i : i + 2], "sum") for i in (0, 2, 4)]
    torch.testing.assert_close(sum(parts), per[mask.reshape(10)].sum())


@pytest.mark.parametrize("tied", [False, True])
def test_loss_from_labels_equals_lm_loss_of_logits(tied):
    """``model(x, labels=y)`` (logits never materialised) equals lm_loss(model(x), y): value and every gradient."""
    cfg = tiny(share_embeddings_and_output_weights=tied)
    torch.manual_seed(0)
    model = GPT(cfg).double()
    x = tokens(cfg, seed=3)
    y = torch.roll(x, -1, 1)
    mask = torch.rand(x.shape, generator=torch.Generator().manual_seed(1)) > 0.3
    for kwargs in ({}, {"loss_mask": mask}, {"loss_mask": mask, "reduction": "sum"}):
        model.zero_grad()
        fused = model(x, labels=y, **kwargs)
        fused.backward()
        g_fused = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        ref = lm_loss(model(x), y, kwargs.get("loss_mask"), kwargs.get("reduction", "mean"))
        ref.backward()
        torch.testing.assert_close(fused, ref, rtol=1e-12, atol=1e-12)
        for n, p in model.named_parameters():
            torch.testing.assert_close(g_fused[n], p.grad, rtol=1e-10, atol=1e-12, msg=n)


def test_loss_arguments():
    cfg = tiny()
    model = GPT(cfg)
    x = tokens(cfg)
    with pytest.raises(ValueError, match="reduction"):
        model(x, labels=x, reduction="none")
    with pytest.raises(ValueError, match="loss_mask"):
        model(x, loss_mask=torch.ones_like(x))
