"""flash-attn's window semantics to the letter, on the CPU, against a float64 oracle whose mask is built from
flash-attn's own rules (not from longctx's `Band`):

- a side of the window of Sk or more (``max_seqlen_k`` in the varlen forms) is unbounded;
- then ``causal=True`` sets the right side to 0, whatever was passed (transformers' flash-attention path calls
  ``window_size=(w - 1, w - 1)`` with ``causal=True`` for every sliding-window model);
- query i sees key j iff ``i + Sk - Sq - left <= j <= i + Sk - Sq + right`` (a side of -1 unbounded).

Every combination of causal x left x right x (Sq == Sk, Sq < Sk, Sq > Sk), through `longctx.attention` (tiled
and math), `flash_attn_func` and `flash_attn_varlen_func`; the Triton kernels run the same rule through the
interpreter lane (tests/interpreter).
"""

from __future__ import annotations

import itertools

import pytest
import torch

import longctx
from longctx.masks import flash_window

SHAPES = [(9, 9), (5, 12), (12, 5)]  # (Sq, Sk)
# window sides relative to Sk: unbounded, 0, small, Sk - 1 (the widest bounded), Sk and beyond (unbounded)
SIDES = ["-1", "0", "2", "Sk-1", "Sk", "Sk+5"]


def _side(name: str, sk: int) -> int:
    return {"-1": -1, "0": 0, "2": 2, "Sk-1": sk - 1, "Sk": sk, "Sk+5": sk + 5}[name]


def flash_attn_mask(sq: int, sk: int, causal: bool, window: tuple[int, int], seqlen_k: int | None = None):
    """(Sq, Sk) bool, True = visible, as flash-attn's kernels compute it (the rules in the module docstring)."""
    left, right = window
    bound = sk if seqlen_k is None else seqlen_k
    if left >= bound:
        left = -1
    if right >= bound:
        right = -1
    if causal:
        right = 0
    i = torch.arange(sq)[:, None]
    j = torch.arange(sk)[None, :]
    diag = i + sk - sq
    visible = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        visible &= j >= diag - left
    if right >= 0:
        visible &= j <= diag + right
    return visible


def _oracle(q, k, v, mask):
    """float64 dense attention with a boolean mask; rows that see nothing give 0 (as flash-attn). (B, H, S, D)."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, 1) for t in (k, v))
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.unsqueeze(-1).clamp_min(-1e300)).nan_to_num(0.0)
    return p @ v, lse


def _inputs(sq, sk, seed, hq=4, hkv=2, d=8):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, hq, sq, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, hkv, sk, d, generator=g, dtype=torch.float64) for _ in range(2))
    do = torch.randn(1, hq, sq, d, generator=g, dtype=torch.float64)
    return q, k, v, do


def _fwd_bwd(fn, q, k, v, do):
    a, b, c = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = fn(a, b, c)
    grads = torch.autograd.grad(out, (a, b, c), do, allow_unused=True)
    return [out, lse, *[torch.zeros_like(t) if g is None else g for g, t in zip(grads, (a, b, c))]]


def _close(ours, ref, what):
    for name, a, r in zip(("out", "lse", "dq", "dk", "dv"), ours, ref):
        both_inf = torch.isinf(a) & torch.isinf(r) & (torch.sign(a) == torch.sign(r))
        err = torch.where(both_inf, torch.zeros_like(a), (a - r).abs())
        err = err.detach()
        assert not err.isnan().any() and float(err.max()) <= 1e-10, f"{what} {name}: {float(err.nan_to_num(1e9).max())}"


COMBOS = list(itertools.product([False, True], SIDES, SIDES, SHAPES))


@pytest.mark.parametrize("backend", ["tiled", "math"])
@pytest.mark.parametrize("causal,left,right,shape", COMBOS, ids=lambda x: str(x))
def test_attention_window_as_flash_attn(backend, causal, left, right, shape):
    sq, sk = shape
    window = (_side(left, sk), _side(right, sk))
    q, k, v, do = _inputs(sq, sk, seed=hash((causal, left, right, shape)) % 997)
    mask = flash_attn_mask(sq, sk, causal, window)
    ref = _fwd_bwd(lambda a, b, c: _oracle(a, b, c, mask), q, k, v, do)
    ours = _fwd_bwd(
        lambda a, b, c: longctx.attention(a, b, c, causal=causal, window=window, backend=backend, return_lse=True),
        q, k, v, do,
    )  # fmt: skip
    _close(ours, ref, f"attention {backend} causal={causal} window={window} Sq={sq} Sk={sk}")


@pytest.mark.parametrize("causal,left,right,shape", COMBOS, ids=lambda x: str(x))
def test_flash_attn_func_window(causal, left, right, shape):
    sq, sk = shape
    window = (_side(left, sk), _side(right, sk))
    q, k, v, do = _inputs(sq, sk, seed=7)
    mask = flash_attn_mask(sq, sk, causal, window)
    ref = _fwd_bwd(lambda a, b, c: _oracle(a, b, c, mask), q, k, v, do)

    def run(a, b, c):  # flash-attn's layout (B, S, H, D)
        out, lse, _ = longctx.flash_attn_func(
            *(t.transpose(1, 2) for t in (a, b, c)), causal=causal, window_size=window, return_attn_probs=True
        )
        return out.transpose(1, 2), lse

    _close(_fwd_bwd(run, q, k, v, do), ref, f"flash_attn_func causal={causal} window={window} Sq={sq} Sk={sk}")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("left,right", list(itertools.product(SIDES, SIDES)), ids=str)
def test_flash_attn_varlen_func_window_against_max_seqlen_k(causal, left, right):
    """Documents of (Sq, Sk) = (9, 9), (5, 12), (12, 5) packed; the window's sides are bounded by max_seqlen_k
    (12), as in flash-attn's varlen kernels, not by each document's length."""
    lq, lk = [s[0] for s in SHAPES], [s[1] for s in SHAPES]
    max_k = max(lk)
    window = (_side(left, max_k), _side(right, max_k))
    hq, hkv, d = 4, 2, 8
    g = torch.Generator().manual_seed(11)
    q = torch.randn(sum(lq), hq, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(sum(lk), hkv, d, generator=g, dtype=torch.float64) for _ in range(2))
    do = torch.randn(sum(lq), hq, d, generator=g, dtype=torch.float64)
    cu_q = torch.tensor([0, *torch.tensor(lq).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lk).cumsum(0).tolist()], dtype=torch.int32)

    def oracle(a, b, c):
        outs, lses = [], []
        for i in range(len(lq)):
            qd = a[cu_q[i] : cu_q[i + 1]].permute(1, 0, 2)[None]
            kd, vd = (t[cu_k[i] : cu_k[i + 1]].permute(1, 0, 2)[None] for t in (b, c))
            o, lse = _oracle(qd, kd, vd, flash_attn_mask(lq[i], lk[i], causal, window, seqlen_k=max_k))
            outs.append(o[0].permute(1, 0, 2))
            lses.append(lse[0])
        return torch.cat(outs), torch.cat(lses, 1)

    def run(a, b, c):
        out, lse, _ = longctx.flash_attn_varlen_func(
            a, b, c, cu_q, cu_k, max(lq), max_k, causal=causal, window_size=window, return_attn_probs=True
        )
        return out, lse

    _close(_fwd_bwd(run, q, k, v, do), _fwd_bwd(oracle, q, k, v, do), f"varlen causal={causal} window={window}")


def test_flash_window_rules():
    assert flash_window((63, 63), causal=True, seqlen_k=4096) == (63, 0)  # transformers' sliding-window call
    assert flash_window((5000, 3), causal=False, seqlen_k=4096) == (-1, 3)
    assert flash_window((3, 4096), causal=False, seqlen_k=4096) == (3, -1)
    assert flash_window((3, 4096), causal=True, seqlen_k=4096) == (3, 0)
    assert flash_window(None, causal=True, seqlen_k=16) == (-1, 0)
    with pytest.raises(ValueError, match="window right must be >= -1"):
        flash_window((3, -2), causal=True, seqlen_k=16)


def test_transformers_flash_call_for_a_sliding_window_model():
    """What transformers' flash-attention path passes for Mistral / Qwen2 / Gemma 2 layers: causal=True with
    window_size=(w - 1, w - 1); the result is the causal sliding window of w keys (keys i - w < j <= i)."""
    S, w = 40, 8
    q, k, v, _ = _inputs(S, S, seed=3)
    out = longctx.flash_attn_func(
        *(t.transpose(1, 2) for t in (q, k, v)), causal=True, window_size=(w - 1, w - 1), backend="tiled"
    ).transpose(1, 2)
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    ref, _ = _oracle(q, k, v, (j <= i) & (j > i - w))
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_flash_attn_signatures_are_flash_attns():
    """The README's compatibility table: every flash-attn 2.6+ argument of these functions, in its position."""
    import inspect

    flash = {
        "flash_attn_func": ["q", "k", "v", "dropout_p", "softmax_scale", "causal", "window_size", "softcap",
                            "alibi_slopes", "deterministic", "return_attn_probs"],
        "flash_attn_kvpacked_func": ["q", "kv", "dropout_p", "softmax_scale", "causal", "window_size", "softcap",
                                     "alibi_slopes", "deterministic", "return_attn_probs"],
        "flash_attn_qkvpacked_func": ["qkv", "dropout_p", "softmax_scale", "causal", "window_size", "softcap",
                                      "alibi_slopes", "deterministic", "return_attn_probs"],
        "flash_attn_varlen_func": ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
                                   "dropout_p", "softmax_scale", "causal", "window_size", "softcap", "alibi_slopes",
                                   "deterministic", "return_attn_probs", "block_table"],
    }  # fmt: skip
    for name, params in flash.items():
        got = [p.name for p in inspect.signature(getattr(longctx, name)).parameters.values()]
        assert got[: len(params)] == params, (name, got)
