"""The memory features on a GPU: offloading's copies (bitwise gradients, device memory freed), the kept-attention
recompute, and the memory model's prediction against torch.cuda.max_memory_allocated."""

from __future__ import annotations

import pytest
import torch

from longctx.memory.model import step_memory
from longctx.models.gpt import GPT, GPTConfig

FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def _cfg(**kw) -> GPTConfig:
    base = dict(vocab_size=4096, seq_length=4096, num_layers=4, hidden_size=512, num_attention_heads=8,
                num_query_groups=2, ffn_hidden_size=1408)  # fmt: skip
    return GPTConfig(**{**base, **kw})


def _step(cfg: GPTConfig, S: int = 4096):
    torch.manual_seed(0)
    model = GPT(cfg).cuda()
    x = torch.randint(0, cfg.vocab_size, (1, S), generator=torch.Generator().manual_seed(1)).cuda()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(x, labels=x)
    after_forward = torch.cuda.memory_allocated() - base
    loss.backward()
    torch.cuda.synchronize()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, after_forward


@pytest.fixture
def deterministic(monkeypatch):
    """Bitwise-repeatable backwards: longctx's kernels without atomics and PyTorch's deterministic embedding
    backward (the default ones add in no fixed order, so two identical runs differ in their last bits)."""
    monkeypatch.setenv("LONGCTX_DETERMINISTIC", "1")
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(was)


def test_offloading_gradients_bitwise_and_device_memory_freed(deterministic):
    ref_loss, ref, kept_plain = _step(_cfg(**FULL))
    _, again, _ = _step(_cfg(**FULL))
    assert all(torch.equal(again[n], ref[n]) for n in ref)  # the comparison below can be bitwise
    loss, got, kept_off = _step(_cfg(**FULL, cpu_offloading=True))
    assert torch.equal(loss, ref_loss)
    for n in ref:
        assert torch.equal(got[n], ref[n]), n
    # the four layer inputs (fp32 residual, 4096 x 512) left the device after the forward
    assert kept_plain - kept_off >= 0.9 * 4 * 4096 * 512 * 4, (kept_plain, kept_off)


def test_skip_core_attention_gradients_close():
    ref_loss, ref, _ = _step(_cfg(**FULL))
    loss, got, _ = _step(_cfg(**FULL, recompute_skip_core_attention=True))
    torch.testing.assert_close(loss, ref_loss, rtol=2e-3, atol=2e-3)
    for n in ref:
        rel = (got[n].float() - ref[n].float()).norm() / ref[n].float().norm().clamp_min(1e-12)
        assert rel < 2e-2, (n, float(rel))


@pytest.mark.parametrize("kw", [{}, FULL, dict(FULL, recompute_skip_core_attention=True),
                                dict(FULL, sequence_chunk_size=1024), dict(FULL, cpu_offloading=True)])  # fmt: skip
def test_memory_model_within_five_percent(kw):
    """Predicted peak of a whole step (forward, backward, fused AdamW) within 5% of the measured one."""
    cfg = GPTConfig.preset("llama-350m", **kw)
    S = 16384
    torch.manual_seed(0)
    model = GPT(cfg).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    x = torch.randint(0, cfg.vocab_size, (1, S)).cuda()
    for _ in range(2):  # the second step holds the optimizer states
        torch.cuda.reset_peak_memory_stats()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, labels=x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    measured = torch.cuda.max_memory_allocated()
    predicted = step_memory(cfg, seq_length=S).total
    assert abs(predicted - measured) <= 0.05 * measured, (predicted / 2**30, measured / 2**30)


def test_offloader_round_trip_through_pinned_pieces():
    """A tensor whose bytes are not a power of two (6 MiB + 12 bytes, bf16, not contiguous) comes back exact from
    its pinned pieces, and the host holds its size rounded up to a MiB (7 MiB: 4 + 2 + 1), not to a power of two
    (8)."""
    from longctx.layers.offload import ActivationOffloader

    x = torch.randn(3 * (1 << 19) + 3, 3, device="cuda", dtype=torch.bfloat16)[:, :2]
    off = ActivationOffloader(reserve_bytes=0)
    off.begin()
    slot = off.offload(x)
    back = off.fetch(slot)
    torch.cuda.synchronize()
    assert torch.equal(back, x) and back.shape == x.shape
    assert off.host_bytes == 7 << 20
