"""Recomputation that never recomputes attention (GPTConfig.recompute_skip_core_attention): the same gradients as
full recomputation, one attention forward less per layer (counted), and the kept output and lse (counted)."""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import longctx.layers.attention as attention_layer
from longctx.launchers.select import resolve_launchers
from longctx.masks import Band
from longctx.models.gpt import GPT, GPTConfig

FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def _cfg(**kw) -> GPTConfig:
    base = dict(
        vocab_size=64, seq_length=64, num_layers=3, hidden_size=32, num_attention_heads=4, num_query_groups=2,
        ffn_hidden_size=64, attention_backend="tiled", **FULL,
    )  # fmt: skip
    return GPTConfig(**{**base, **kw})


def _model(cfg, dtype=torch.float64):
    torch.manual_seed(0)
    return GPT(cfg).to(dtype)


def _grads(cfg, x, dtype=torch.float64):
    model = _model(cfg, dtype)
    loss = model(x, labels=torch.roll(x, -1, 1))
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "extra", [{}, dict(recompute_method="uniform", recompute_num_layers=2), dict(cpu_offloading=True)]
)
def test_gradients_equal_full_recompute(extra):
    x = torch.randint(0, 64, (2, 64), generator=torch.Generator().manual_seed(1))
    ref_loss, ref = _grads(_cfg(**extra), x)
    loss, got = _grads(_cfg(recompute_skip_core_attention=True, **extra), x)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-10, atol=1e-12, msg=n)


def test_block_method_keeps_only_checkpointed_layers():
    x = torch.randint(0, 64, (1, 64), generator=torch.Generator().manual_seed(2))
    cfg = dict(recompute_method="block", recompute_num_layers=2)
    ref_loss, ref = _grads(_cfg(**cfg), x)
    loss, got = _grads(_cfg(recompute_skip_core_attention=True, **cfg), x)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-10, atol=1e-12, msg=n)


def test_one_attention_forward_less_per_layer():
    """Attention's matmuls (batched: aten.bmm in the tiled launchers; the linears are aten.mm) fall by one attention
    forward per layer. (The replayed chunk also recomputes its last linear, whose output the backward does not
    need: PyTorch's non-reentrant checkpoint stops before it.)"""
    B, S, L = 1, 64, 3
    x = torch.randint(0, 64, (B, S), generator=torch.Generator().manual_seed(3))

    def step_flops(cfg) -> int:
        model = _model(cfg)
        with FlopCounterMode(display=False) as counter:
            model(x, labels=torch.roll(x, -1, 1)).backward()
        return counter.get_flop_counts()["Global"][torch.ops.aten.bmm]

    q = torch.randn(B, 4, S, 8, dtype=torch.float64)
    kv = torch.randn(B, 2, S, 8, dtype=torch.float64)
    with FlopCounterMode(display=False) as counter:
        resolve_launchers("auto", q.device, q.dtype).forward(q, kv, kv, scale=8**-0.5, band=Band(None, 0))
    attention_forward = counter.get_flop_counts()["Global"][torch.ops.aten.bmm]
    assert attention_forward > 0
    saved = step_flops(_cfg()) - step_flops(_cfg(recompute_skip_core_attention=True))
    assert saved == L * attention_forward, (saved, attention_forward)


def _counting_launchers(calls: list):
    """`resolve_launchers` whose forward counts its calls (the kept path's attention forwards)."""

    def resolve(*args, **kwargs):
        launchers = resolve_launchers(*args, **kwargs)

        def forward(*a, **k):
            calls.append(1)
            return launchers.forward(*a, **k)

        return dataclasses.replace(launchers, forward=forward)

    return mock.patch.object(attention_layer, "resolve_launchers", resolve)


def test_eval_and_no_grad_keep_nothing():
    model = _model(_cfg(recompute_skip_core_attention=True))
    x = torch.randint(0, 64, (1, 64), generator=torch.Generator().manual_seed(4))
    calls = []
    with _counting_launchers(calls):
        with torch.no_grad():
            model(x)
        model.eval()
        model(x)
        assert calls == []  # no chunk recorded: attention ran as without the option
        model.train()
        model(x, labels=torch.roll(x, -1, 1)).backward()
    assert len(calls) == model.config.num_layers


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(recompute_granularity="selective", recompute_method=None, recompute_num_layers=None), "full"),
        (dict(attention_dropout=0.1), "attention_dropout"),
    ],
)
def test_bad_settings(kw, match):
    with pytest.raises(ValueError, match=match):
        _cfg(recompute_skip_core_attention=True, **kw)
