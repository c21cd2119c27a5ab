"""Activation offloading (GPTConfig.cpu_offloading): gradients bitwise equal to the same recomputation without it,
and the chunk inputs no longer kept by autograd. The copies to pinned host memory run on a GPU (tests/gpu)."""

from __future__ import annotations

import pytest
import torch

from longctx.layers.offload import ActivationOffloader, host_memory_available, pinned_pieces
from longctx.memory import saved_bytes
from longctx.models.gpt import GPT, GPTConfig

FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def _cfg(**kw) -> GPTConfig:
    base = dict(
        vocab_size=64, seq_length=64, num_layers=3, hidden_size=32, num_attention_heads=4, num_query_groups=2,
        ffn_hidden_size=64, attention_backend="tiled", **FULL,
    )  # fmt: skip
    return GPTConfig(**{**base, **kw})


def _step(cfg: GPTConfig, x: torch.Tensor, dtype=torch.float32):
    torch.manual_seed(0)
    model = GPT(cfg).to(dtype)
    torch.manual_seed(1)  # the dropout masks
    loss = model(x, labels=torch.roll(x, -1, 1))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("num_layers_offloaded", [None, 1, 2])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_gradients_bitwise_equal_to_no_offloading(num_layers_offloaded, dropout):
    x = torch.randint(0, 64, (2, 64), generator=torch.Generator().manual_seed(3))
    kw = dict(hidden_dropout=dropout)
    ref_loss, ref = _step(_cfg(**kw), x)
    loss, got = _step(_cfg(cpu_offloading=True, cpu_offloading_num_layers=num_layers_offloaded, **kw), x)
    assert torch.equal(loss, ref_loss)
    for n in ref:
        assert torch.equal(got[n], ref[n]), n


def test_bf16_autocast_replayed_in_the_backward():
    x = torch.randint(0, 64, (1, 64), generator=torch.Generator().manual_seed(4))

    def run(cfg):
        torch.manual_seed(0)
        model = GPT(cfg)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x, labels=torch.roll(x, -1, 1))
        loss.backward()
        return {n: p.grad for n, p in model.named_parameters()}

    ref, got = run(_cfg()), run(_cfg(cpu_offloading=True))
    for n in ref:
        assert torch.equal(got[n], ref[n]), n


def test_chunk_inputs_leave_autograd():
    """What autograd keeps falls by one hidden state (B, S, h) per offloaded layer."""
    B, S, h, L = 2, 64, 32, 3
    x = torch.randint(0, 64, (B, S), generator=torch.Generator().manual_seed(5))

    def kept(cfg):
        torch.manual_seed(0)
        model = GPT(cfg)
        return saved_bytes(lambda: model(x, labels=torch.roll(x, -1, 1)))

    plain, offloaded = kept(_cfg()), kept(_cfg(cpu_offloading=True))
    assert plain - offloaded == L * B * S * h * 4, (plain, offloaded)


def test_offloader_keeps_cpu_tensors_in_place():
    """A CPU tensor is already in host memory: the offloader keeps that very tensor in its slot (no copy); the
    device-to-host round trip itself is a GPU test (tests/gpu/test_memory_gpu.py)."""
    off = ActivationOffloader()
    off.begin()
    ts = [torch.randn(3, 4) for _ in range(3)]
    slots = [off.offload(t) for t in ts]
    assert slots == [0, 1, 2]
    for i in reversed(slots):
        assert off.fetch(i) is ts[i]


def test_host_memory_is_read():
    avail = host_memory_available()
    assert avail is None or avail > 0


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(cpu_offloading=True, recompute_granularity=None, recompute_method=None, recompute_num_layers=None),
         "recompute_granularity='full'"),
        (dict(cpu_offloading=True, cpu_offloading_activations=False), "activations"),
        (dict(cpu_offloading=True, cpu_offloading_num_layers=4), "cpu_offloading_num_layers"),
        (dict(cpu_offloading="yes"), "True or False"),
    ],
)  # fmt: skip
def test_bad_settings(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        _cfg(**kw)


def test_pinned_pieces_hold_a_buffer_to_a_mib():
    """Pinned buffers are pieces of power-of-two sizes (torch's pinned allocator rounds each block up to one): a
    3 GiB checkpoint takes 2 + 1 GiB, not 4."""
    GiB, MiB = 1 << 30, 1 << 20
    assert pinned_pieces(3 * GiB) == [2 * GiB, GiB]
    assert pinned_pieces(1) == [MiB]
    for n in (3 * GiB + 5, 393216 * 4096 * 2, 77 * MiB - 3, 12345678):
        pieces = pinned_pieces(n)
        assert n <= sum(pieces) < n + MiB
        assert all(p & (p - 1) == 0 for p in pieces) and pieces == sorted(pieces, reverse=True)
        assert len(set(pieces)) == len(pieces)
