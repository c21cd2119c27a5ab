"""The tiled backend's forward+backward memory grows linearly with S; math's grows with S^2."""

from __future__ import annotations

import torch

import longctx
from longctx.memory.measure import peak_live_bytes, saved_bytes


def _measure(backend: str, S: int, B=1, H=4, D=32):
    q, k, v = (torch.randn(B, H, S, D, requires_grad=True) for _ in range(3))

    def fwd():
        return longctx.attention(q, k, v, causal=True, backend=backend)

    def fwd_bwd():
        fwd().sum().backward()

    return saved_bytes(fwd), peak_live_bytes(fwd_bwd)


def test_tiled_saves_only_inputs_output_and_lse():
    S, B, H, D = 512, 1, 4, 32
    saved, _ = _measure("tiled", S, B, H, D)
    elem = 4  # float32
    expected = 4 * B * H * S * D * elem + B * H * S * 4  # q, k, v, out + lse
    assert saved == expected


def test_tiled_memory_is_linear_and_math_quadratic():
    lengths = [256, 512, 1024]
    tiled = [_measure("tiled", S) for S in lengths]
    math = [_measure("math", S) for S in lengths]
    for i in range(1, len(lengths)):
        # doubling S: tiled saved bytes double exactly, peak at most ~doubles (+ one tile of scores)
        assert tiled[i][0] == 2 * tiled[i - 1][0]
        assert tiled[i][1] <= 2.2 * tiled[i - 1][1]
        # math keeps the S x S probabilities: close to 4x per doubling
        assert math[i][0] >= 3.5 * math[i - 1][0]
        assert math[i][1] >= 3.5 * math[i - 1][1]
    assert math[-1][1] > 8 * tiled[-1][1]


def test_peak_tracker_counts_a_known_allocation():
    x = torch.randn(1000)

    def f():
        y = torch.empty(256, 1024)  # 1 MiB
        z = y.add_(1.0) * 2  # another 1 MiB while y is alive
        del y, z

    assert peak_live_bytes(f) == 2 * 2**20
    _ = x


def test_expandable_segments_is_the_default_and_a_users_setting_wins(monkeypatch):
    from longctx.memory.measure import expandable_segments

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert expandable_segments() == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    assert expandable_segments() == "max_split_size_mb:512"
