"""Causal self-attention: one fused qkv projection, RoPE, GQA, and a replaceable core attention.

    x (B, S, h) --linear_qkv--> q (B, Hq, S, D), k, v (B, Hkv, S, D)     Hkv = num_query_groups
              --RoPE(position_ids)--> q, k
              --core_attention(q, k, v)--> (B, Hq, S, D)                 longctx.attention(causal=True)
              --linear_proj--> (B, S, h)

K/V are passed to the core attention *un-repeated*: query head h reads kv head h // (Hq // Hkv), as in
`longctx.attention`, so GQA never materialises repeated K/V.

The core attention is the seam for context parallelism: `SelfAttention.core_attention` is any callable
``fn(q, k, v) -> out`` with the shapes above (causal attention over the sequence this rank holds, in
whatever global order its positions have). `GPT.set_core_attention(fn)` installs it in every layer; the
default is `default_core_attention`, i.e. ``longctx.attention(q, k, v, causal=True, backend=...)``.
A replacement is assumed to be fused (memory linear in S, as ring attention over flash launchers is), so
selective recomputation leaves it alone; set ``fn.unfused = True`` to have it recomputed.

Packed documents: `DocumentAttention` is a core attention that is causal inside documents and blind across
them. The boundaries change with every batch, so it holds them (``set_documents(cu_seqlens)`` before the
forward, kept until the next call, so a recomputed forward in the backward sees the same documents) and runs
the B rows as one packed sequence through `flash_attn_varlen_func`.

Recomputation that never recomputes attention (``keep_core_attention``, LightSeq's rematerialization-aware
checkpointing; `kept_causal_attention`, which the transformers integration calls too): inside a chunk run by
`longctx.layers.offload.OffloadedCheckpoint`, the forward keeps the core attention's output and log-sum-exp, and the
recomputed forward in the backward reads them back instead of running attention again; the backward of attention
(which recomputes the scores anyway) runs from q, k, v, out and lse through the launchers of
`longctx.launchers.select` ("auto": longctx's Triton kernels on CUDA for float16/bfloat16, the tiled ones in plain
PyTorch otherwise). The price is one (B, S, Hq D) output and one (B, Hq, S) float32 lse kept per layer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from longctx.api import attention, explain, flash_attn_varlen_func
from longctx.api.core import follow_autocast
from longctx.launchers.select import resolve_launchers
from longctx.layers.offload import is_recording, is_replaying, kept_results
from longctx.layers.recompute import checkpoint_call, recompute_active
from longctx.layers.rotary import apply_rotary
from longctx.masks import Band

__all__ = [
    "CoreAttentionFn",
    "SelfAttention",
    "DocumentAttention",
    "default_core_attention",
    "dense_attention_with_dropout",
    "kept_causal_attention",
]

CoreAttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def dense_attention_with_dropout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float) -> torch.Tensor:
    """Causal softmax attention with dropout on the probabilities (unfused: memory quadratic in S).

    The fused backends of longctx have no attention dropout, so training with ``attention_dropout > 0``
    takes this path. q (B, Hq, S, D); k, v (B, Hkv, S, D) -> (B, Hq, S, D).
    """
    B, Hq, S, D = q.shape
    Hkv = k.shape[1]
    q5 = q.reshape(B, Hkv, Hq // Hkv, S, D)  # query heads of one group share a kv head (no copy of K/V)
    s = torch.matmul(q5.float(), k.float().unsqueeze(2).transpose(-1, -2)) * D**-0.5  # (B, Hkv, G, S, S)
    causal = torch.ones(S, S, dtype=torch.bool, device=q.device).tril()
    probs = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1)
    probs = F.dropout(probs, p=p, training=True)
    out = torch.matmul(probs, v.float().unsqueeze(2))  # (B, Hkv, G, S, D)
    return out.reshape(B, Hq, S, D).to(q.dtype)


def default_core_attention(backend: str = "auto") -> CoreAttentionFn:
    """``fn(q, k, v) = longctx.attention(q, k, v, causal=True, backend=backend)``."""

    def core_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attention(q, k, v, causal=True, backend=backend)

    core_attention.backend = backend  # type: ignore[attr-defined]
    return core_attention


_VARLEN_BACKENDS = ("tiled", "triton_sparse", "math")


class DocumentAttention:
    """Core attention over packed documents: causal inside each document, nothing across documents.

    ``fn = DocumentAttention(backend); model.set_core_attention(fn)``; before each forward,
    ``fn.set_documents(cu_seqlens)`` with the boundaries of the batch's B rows packed end to end (B * S tokens;
    `longctx.masks.packing.packed_cu_seqlens`). Every call runs ``flash_attn_varlen_func(causal=True)`` over
    that packed sequence, which is the per-row computation when every row starts a document.

    It deliberately has no ``backend`` attribute: layers treat it as a fused replacement (the kept-attention
    replay of ``recompute_skip_core_attention``, which assumes plain causal attention, stays off).

    Args:
        backend: the model's attention backend; "tiled", "triton_sparse" and "math" are passed on, "triton"
            becomes "triton_sparse", anything else "auto" (flash_attn_varlen_func's choice).
    """

    unfused = False

    def __init__(self, backend: str = "auto") -> None:
        if backend == "triton":
            backend = "triton_sparse"
        self.varlen_backend = backend if backend in _VARLEN_BACKENDS else "auto"
        self.cu_seqlens: torch.Tensor | None = None
        self.max_seqlen = 0
        self._total = 0  # tokens the documents cover, read once per batch (a host int: no sync per layer)
        # the boundaries on the tensors' device, one tensor for every layer of the batch: flash_attn_varlen_func
        # reads a cu_seqlens tensor's values once (a device-to-host sync), not once per layer
        self._on_device: torch.Tensor | None = None

    def set_documents(self, cu_seqlens: torch.Tensor) -> None:
        """The boundaries of the next forward(s): int tensor (documents + 1,), 0 then cumulative lengths over the
        B * S tokens of the batch packed row after row.

        Raises:
            ValueError: not a 1-d integer tensor starting at 0 and non-decreasing.
        """
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point():
            got = tuple(cu_seqlens.shape) if isinstance(cu_seqlens, torch.Tensor) else type(cu_seqlens).__name__
            raise ValueError(f"set_documents takes a 1-d integer cu_seqlens tensor, got {got}")
        lengths = cu_seqlens.diff()
        if len(cu_seqlens) < 2 or int(cu_seqlens[0]) != 0 or bool((lengths < 0).any()):
            raise ValueError(
                f"cu_seqlens must start at 0 and not decrease (0, then cumulative document lengths), got "
                f"{cu_seqlens.tolist()[:8]}{' ...' if len(cu_seqlens) > 8 else ''}"
            )
        self.cu_seqlens = cu_seqlens.to(torch.int32)
        self.max_seqlen = int(lengths.max())
        self._total = int(cu_seqlens[-1])
        self._on_device = None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (B, Hq, S, D); k, v (B, Hkv, S, D) -> (B, Hq, S, D)."""
        B, Hq, S, D = q.shape
        Hkv = k.shape[1]
        cu = self.cu_seqlens
        if cu is None or self._total != B * S:
            have = "no documents were set" if cu is None else f"the documents cover {self._total} tokens"
            raise ValueError(
                f"DocumentAttention got {B} rows of {S} tokens ({B * S} packed) but {have}; call "
                "set_documents(packed cu_seqlens of this batch) before the forward"
            )
        if self._on_device is None or self._on_device.device != q.device:
            self._on_device = cu.to(q.device)
        cu = self._on_device
        q_THD = q.transpose(1, 2).reshape(B * S, Hq, D)  # (B S, Hq, D): rows packed end to end
        k_THD = k.transpose(1, 2).reshape(B * S, Hkv, D)  # (B S, Hkv, D)
        v_THD = v.transpose(1, 2).reshape(B * S, Hkv, D)  # (B S, Hkv, D)
        out = flash_attn_varlen_func(
            q_THD, k_THD, v_THD, cu, cu, self.max_seqlen, self.max_seqlen, causal=True, backend=self.varlen_backend
        )  # (B S, Hq, D)
        return out.view(B, S, Hq, D).transpose(1, 2)  # (B, Hq, S, D)


class _KeptAttention(torch.autograd.Function):
    """``out`` (kept from the forward) as the output of attention over q, k, v; the backward runs the attention
    backward from the kept ``out`` and ``lse``. q (B, Hq, S, D); k, v (B, Hkv, S, D); lse (B, Hq, S)."""

    @staticmethod
    def forward(ctx, q, k, v, out, lse, scale: float):
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale = scale
        return out.view_as(out)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        bwd = resolve_launchers("auto", q.device, q.dtype).backward
        dq, dk, dv = bwd(dout.contiguous(), q, k, v, out, lse, scale=ctx.scale, band=_CAUSAL)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


_CAUSAL = Band(None, 0)  # causal self-attention: Sq == Sk, key j <= query i


def kept_causal_attention(
    owner: object, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor | None:
    """Causal self-attention that a fully recomputed chunk runs forward once and backward once (the module doc).

    Inside the chunk's forward (`longctx.layers.offload.is_recording`) it runs the launchers' forward and keeps
    ``(out, lse)`` under ``owner`` in the chunk's `kept_results`; in the chunk's recomputation (`is_replaying`) it
    returns what ``owner`` kept there through `_KeptAttention`, whose backward is attention's backward. Elsewhere,
    or when ``owner`` kept nothing, it returns None and the caller runs its attention as usual. Only for plain
    causal attention over one sequence (Sq == Sk; no window, softcap, padding or packed documents): the caller
    decides, the same way in the forward and in its recomputation. Under ``torch.autocast`` q, k and v are cast as
    `longctx.attention` casts them.

    Args:
        owner: what keeps the result, a dict key (the layer; one call per layer and chunk, or several read back in
            their order).
        q: (B, Hq, S, D); k, v: (B, Hkv, S, D), Hq a multiple of Hkv.
        scale: the softmax scale.

    Returns:
        out (B, Hq, S, D) in q's dtype (the autocast dtype inside autocast), or None.
    """
    kept = kept_results()
    if kept is None:
        return None
    q, k, v, run_ctx = follow_autocast(q, k, v)
    if is_recording():  # the chunk's forward, whose activations are dropped: keep out and lse
        with run_ctx:
            out, lse = resolve_launchers("auto", q.device, q.dtype).forward(q, k, v, scale=scale, band=_CAUSAL)
        kept.setdefault(owner, []).append((out, lse))
        return out
    mine = kept.get(owner)
    if not (is_replaying() and mine):
        return None
    out, lse = mine.pop(0)  # its recomputation in the backward: read them back
    assert out.shape == q.shape, "a recomputation reads back what its own forward kept"
    return _KeptAttention.apply(q, k, v, out, lse, scale)


class SelfAttention(nn.Module):
    """Multi-head, grouped-query or multi-query causal self-attention.

    Args:
        hidden_size: model width h.
        num_attention_heads: query heads Hq.
        num_query_groups: key/value heads Hkv (a divisor of Hq; Hq for multi-head, 1 for MQA).
        kv_channels: head dim D.
        attention_dropout: dropout on the attention probabilities (training only; takes the unfused path).
        backend: the `longctx.attention` backend of the default core attention.
        bias: biases on linear_qkv and linear_proj.
    """

    def __init__(
        self,
        hidden_size: int,
        num_attention_heads: int,
        num_query_groups: int,
        kv_channels: int,
        attention_dropout: float = 0.0,
        backend: str = "auto",
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.num_heads = num_attention_heads
        self.num_groups = num_query_groups
        self.head_dim = kv_channels
        self.attention_dropout = attention_dropout
        self.backend = backend
        qkv_out = (num_attention_heads + 2 * num_query_groups) * kv_channels
        self.linear_qkv = nn.Linear(hidden_size, qkv_out, bias=bias)
        self.linear_proj = nn.Linear(num_attention_heads * kv_channels, hidden_size, bias=bias)
        self.core_attention: CoreAttentionFn = default_core_attention(backend)
        # Set by the recomputation policy (longctx.layers.recompute): checkpoint the core attention when it is unfused.
        self.recompute_core_attention = False
        # Set by the recomputation policy: keep the attention output for the recomputed forward (see the module doc).
        self.keep_core_attention = False

    def set_core_attention(self, fn: CoreAttentionFn | None) -> None:
        """Replace the core attention (None restores ``longctx.attention(causal=True, backend=...)``)."""
        self.core_attention = default_core_attention(self.backend) if fn is None else fn

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.attention_dropout > 0 and self.training:
            return dense_attention_with_dropout(q, k, v, self.attention_dropout)
        if self.keep_core_attention and getattr(self.core_attention, "backend", None) is not None:
            out = kept_causal_attention(self, q, k, v, self.head_dim**-0.5)
            if out is not None:
                return out
        return self.core_attention(q, k, v)

    def core_is_unfused(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Whether the core attention keeps O(S^2) activations for backward (so selective recompute pays off)."""
        if self.attention_dropout > 0 and self.training:
            return True
        backend = getattr(self.core_attention, "backend", None)
        if backend is None:  # a replacement (e.g. context parallelism): fused unless it says otherwise
            return bool(getattr(self.core_attention, "unfused", False))
        choice = explain(q, k, v, causal=True, backend=backend)
        return choice.backend.family == "reference"

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x (B, S, h); cos, sin (S, D) or (B, S, D) from `RotaryEmbedding` -> (B, S, h)."""
        B, S, _ = x.shape
        Hq, Hkv, D = self.num_heads, self.num_groups, self.head_dim
        qkv = self.linear_qkv(x)  # (B, S, (Hq + 2 Hkv) D)
        q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
        q = q.view(B, S, Hq, D).transpose(1, 2)  # (B, Hq, S, D)
        k = k.view(B, S, Hkv, D).transpose(1, 2)  # (B, Hkv, S, D)
        v = v.view(B, S, Hkv, D).transpose(1, 2)  # (B, Hkv, S, D)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        if self.recompute_core_attention and recompute_active(self) and self.core_is_unfused(q, k, v):
            out = checkpoint_call(self._core, q, k, v)  # selective: only the core attention is recomputed
        else:
            out = self._core(q, k, v)  # (B, Hq, S, D)
        out = out.transpose(1, 2).reshape(B, S, Hq * D)  # (B, S, Hq D)
        return self.linear_proj(out)
