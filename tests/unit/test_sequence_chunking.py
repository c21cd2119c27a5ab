"""Sequence-chunked position-wise layers (GPTConfig.sequence_chunk_size): same results, a smaller working set."""

from __future__ import annotations

import pytest
import torch

from longctx.memory import peak_live_bytes
from longctx.models.gpt import GPT, GPTConfig


def _cfg(**kw) -> GPTConfig:
    base = dict(
        vocab_size=64, seq_length=96, num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
        ffn_hidden_size=256, attention_backend="tiled",
    )  # fmt: skip
    return GPTConfig(**{**base, **kw})


def _loss_and_grads(cfg: GPTConfig, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = GPT(cfg).double()
    loss = model(x, labels=torch.roll(x, -1, 1))
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "recompute", [{}, dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)]
)
@pytest.mark.parametrize("chunk", [1, 17, 32, 95])
def test_chunked_equals_unchunked(chunk, recompute):
    x = torch.randint(0, 64, (2, 96), generator=torch.Generator().manual_seed(1))
    ref_loss, ref_grads = _loss_and_grads(_cfg(**recompute), x)
    loss, grads = _loss_and_grads(_cfg(sequence_chunk_size=chunk, **recompute), x)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    for n, g in ref_grads.items():
        torch.testing.assert_close(grads[n], g, rtol=1e-10, atol=1e-12, msg=n)


def test_eval_and_no_grad_run_unchunked_and_equal():
    x = torch.randint(0, 64, (1, 96), generator=torch.Generator().manual_seed(2))
    torch.manual_seed(0)
    a = GPT(_cfg()).double().eval()
    torch.manual_seed(0)
    b = GPT(_cfg(sequence_chunk_size=16)).double().eval()
    with torch.no_grad():
        torch.testing.assert_close(a(x), b(x), rtol=0, atol=0)


def test_chunking_lowers_the_peak_of_a_recomputed_step():
    """With full recomputation the backward of a layer holds its MLP intermediates (S, 2 ffn) at once; chunked,
    one chunk's. The peak of live bytes falls by most of that."""
    S, ffn = 512, 1024
    x = torch.randint(0, 64, (1, S), generator=torch.Generator().manual_seed(3))
    full = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)

    def step(cfg):
        torch.manual_seed(0)
        model = GPT(cfg)
        return lambda: model(x, labels=torch.roll(x, -1, 1)).backward()

    whole = peak_live_bytes(step(_cfg(seq_length=S, ffn_hidden_size=ffn, **full)))
    chunked = peak_live_bytes(step(_cfg(seq_length=S, ffn_hidden_size=ffn, sequence_chunk_size=64, **full)))
    mlp_working_set = S * 3 * ffn * 4  # gate/up (S, 2 ffn) and silu(gate) * up (S, ffn), float32
    assert whole - chunked > 0.5 * mlp_working_set, (whole, chunked)


def test_training_mode_without_autograd_runs_chunked_and_equal():
    """The first forward of a layer under an offloaded checkpoint runs without autograd in training mode: its MLP
    goes chunk by chunk into one output (nothing kept, no checkpoint), with the whole MLP's result and a working set
    of one chunk."""
    from longctx.layers.recompute import run_in_chunks

    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(32, 1024), torch.nn.SiLU(), torch.nn.Linear(1024, 32)).train()
    x = torch.randn(2, 512, 32)
    with torch.no_grad():
        whole = peak_live_bytes(lambda: mlp(x))
        chunked = peak_live_bytes(lambda: run_in_chunks(mlp, x, 64, mlp))
        torch.testing.assert_close(run_in_chunks(mlp, x, 64, mlp), mlp(x), rtol=1e-6, atol=1e-6)
    assert chunked < whole / 4, (whole, chunked)
    assert run_in_chunks(mlp, x, 1000, mlp).shape == x.shape  # one chunk: whole


def test_bad_chunk_size():
    with pytest.raises(ValueError, match="sequence_chunk_size"):
        _cfg(sequence_chunk_size=0)
