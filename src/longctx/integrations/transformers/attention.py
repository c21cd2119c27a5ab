"""The attention implementation ``"longctx"`` of transformers models: the mask interface (`longctx_mask` returns a
`LongctxMask`: causal or not, the window, the padding or the packed documents) and the attention call
(`longctx_attention_forward`: dense, varlen for padded or packed rows, context parallel under `apply`'s group, kept
for the recomputation under `apply`'s ``recompute_skip_core_attention``). Importing the package registers both
(`register`)."""

from __future__ import annotations

import math
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers import masking_utils as _masking
from transformers.masking_utils import AttentionMaskInterface

from longctx.api.core import attention, follow_autocast
from longctx.api.varlen import flash_attn_varlen_func
from longctx.distributed import ContextParallel, cp_attention
from longctx.layers.attention import kept_causal_attention

__all__ = ["ATTN_IMPLEMENTATION", "LongctxMask", "longctx_attention_forward", "longctx_mask", "register"]

ATTN_IMPLEMENTATION = "longctx"

_SDPA_HINT = "use attn_implementation='sdpa' (or 'eager') for this model"


# -- the mask ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Varlen:
    """Packed-token metadata for `flash_attn_varlen_func`: token indices into the flattened (B * S) axis (None:
    every token), int32 cumulative lengths, longest document."""

    idx_q: torch.Tensor | None
    idx_k: torch.Tensor | None
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int


@dataclass(frozen=True)
class LongctxMask:
    """The attention mask of a ``"longctx"`` model, as its mask creation described it.

    Attributes:
        causal: the causal rule (False: bidirectional).
        window: transformers' sliding window ``w`` (query i sees keys ``i - w < j <= i``), or None.
        padding: (B, Sk) bool, True on real tokens, when some token is padding; else None.
        documents: (B, S) int, the document of every token of packed rows; None when every row is one document.
        varlen: the varlen metadata of ``padding`` or ``documents`` (None when both are None).
    """

    causal: bool
    window: int | None
    padding: torch.Tensor | None = None
    documents: torch.Tensor | None = None
    varlen: _Varlen | None = None


def _cells(fn: Callable) -> dict[str, Any]:
    code = getattr(fn, "__code__", None)
    if code is None or not fn.__closure__:
        return {}
    return {name: cell.cell_contents for name, cell in zip(code.co_freevars, fn.__closure__)}


def _read_mask_function(fn: Callable) -> tuple[bool, int | None, torch.Tensor | None]:
    """``(causal, window, documents)`` of a mask function built by transformers' masking_utils; raises for a rule
    longctx does not implement (so that no layer silently computes another mask than the model asked for)."""
    leaves: list[Callable] = []

    def walk(f: Callable) -> None:
        if getattr(f, "__qualname__", "") == "and_masks.<locals>.and_mask":
            for g in _cells(f)["mask_functions"]:
                walk(g)
        else:
            leaves.append(f)

    walk(fn)
    causal: bool | None = None
    window: int | None = None
    documents: torch.Tensor | None = None
    for f in leaves:
        name = getattr(f, "__qualname__", repr(f))
        if f is _masking.causal_mask_function:
            causal = True
        elif f is _masking.bidirectional_mask_function:
            causal = False if causal is None else causal
        elif name == "sliding_window_overlay.<locals>.inner_mask":
            window = int(_cells(f)["sliding_window"])
        elif name == "packed_sequence_mask_function.<locals>.inner_mask":
            documents = _cells(f)["packed_sequence_mask"]
        elif name == "padding_mask_function.<locals>.inner_mask":
            pass  # the padding also arrives as the 2-D attention_mask
        else:
            raise ValueError(
                f"attn_implementation='longctx' does not implement the mask rule {name!r} that this model builds "
                "(e.g. chunked attention, bidirectional blocks for image tokens, or_mask_function/and_mask_function "
                f"overlays); {_SDPA_HINT}"
            )
    if causal is None:
        raise ValueError(
            f"attn_implementation='longctx' found no causal or bidirectional base rule in the mask {fn!r}; {_SDPA_HINT}"
        )
    if window is not None and not causal:
        raise ValueError(
            "attn_implementation='longctx' implements sliding windows for causal attention only, got a bidirectional "
            f"sliding window of {window}; {_SDPA_HINT}"
        )
    return causal, window, documents


def _cu(lengths: torch.Tensor) -> torch.Tensor:
    return F.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))  # (n + 1,) int32


def _padding_varlen(valid_k: torch.Tensor, q_length: int) -> _Varlen:
    valid_q = valid_k[:, -q_length:]  # queries are the last q_length positions (a KV cache before them)
    lens_k = valid_k.sum(-1, dtype=torch.int32)  # (B,)
    idx_k = valid_k.flatten().nonzero().flatten()
    cu_k, max_k = _cu(lens_k), int(lens_k.max())
    if valid_q.shape[1] == valid_k.shape[1]:
        return _Varlen(idx_k, idx_k, cu_k, cu_k, max_k, max_k)
    lens_q = valid_q.sum(-1, dtype=torch.int32)
    idx_q = valid_q.flatten().nonzero().flatten()
    return _Varlen(idx_q, idx_k, _cu(lens_q), cu_k, int(lens_q.max()), max_k)


def _documents_varlen(documents: torch.Tensor) -> _Varlen:
    B, S = documents.shape
    starts = torch.ones(B, S, dtype=torch.bool, device=documents.device)  # a document starts at every row start
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    first = starts.flatten().nonzero().flatten().to(torch.int32)
    cu = torch.cat([first, first.new_tensor([B * S])])  # (n_docs + 1,) int32
    longest = int(cu.diff().max())
    return _Varlen(None, None, cu, cu, longest, longest)


_FROM_POSITIONS: OrderedDict = OrderedDict()  # id(position_ids) -> (weakref, version, _Varlen | None)


def _varlen_from_positions(position_ids: torch.Tensor, batch: int) -> _Varlen | None:
    """Documents where ``position_ids`` do not go up by one (transformers' packed-sequence rule), read once per
    position_ids tensor: every layer of a forward passes the same one."""
    key = id(position_ids)
    hit = _FROM_POSITIONS.get(key)
    if hit is not None and hit[0]() is position_ids and hit[1] == position_ids._version:
        return hit[2]
    pos = position_ids.expand(batch, -1)  # (B, S)
    diff = torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1)
    documents = (diff != 1).cumsum(-1)
    meta = _documents_varlen(documents) if bool((documents[:, -1] != 0).any()) else None
    _FROM_POSITIONS[key] = (weakref.ref(position_ids), position_ids._version, meta)
    while len(_FROM_POSITIONS) > 8:
        _FROM_POSITIONS.popitem(last=False)
    return meta


def longctx_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable = _masking.causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> LongctxMask:
    """transformers' mask creation for ``attn_implementation="longctx"`` (registered with AttentionMaskInterface).

    Args:
        batch_size, q_length, kv_length, q_offset, kv_offset: as transformers passes them.
        mask_function: the rule the model asked for (causal or bidirectional, a sliding-window overlay, the packed
            documents that transformers found in ``position_ids``).
        attention_mask: (B, >= kv_length) bool padding mask (True = real token) or None.
        **kwargs: transformers' other arguments (dtype, device, config, ...), unused.

    Returns:
        A `LongctxMask`, with the varlen metadata of the padding or the documents computed once for all layers.

    Raises:
        ValueError: a mask rule longctx does not implement.
    """
    causal, window, documents = _read_mask_function(mask_function)
    padding = None
    if attention_mask is not None:
        padding = attention_mask[:, -kv_length:].to(torch.bool)  # (B, Sk)
        if padding.shape[1] == kv_length and bool(padding.all()):
            padding = None
    if padding is not None:
        return LongctxMask(causal, window, padding=padding, varlen=_padding_varlen(padding, q_length))
    if documents is not None and q_length == kv_length:
        return LongctxMask(causal, window, documents=documents, varlen=_documents_varlen(documents))
    return LongctxMask(causal, window)


# -- the attention ----------------------------------------------------------------------------------------------

_collector: Any
try:  # where transformers collects output_attentions / output_hidden_states (a ContextVar-like holder)
    from transformers.utils.output_capturing import _active_collector as _collector
except ImportError:  # pragma: no cover - other transformers layouts
    _collector = None


def _collecting(key: str) -> bool:
    collected = _collector.get() if _collector is not None else None
    return isinstance(collected, dict) and key in collected


def _unsupported(module: nn.Module, dropout: float, kwargs: dict[str, Any]) -> None:
    config = getattr(module, "config", None)
    if kwargs.get("output_attentions") or _collecting("attentions"):
        raise ValueError(
            "attn_implementation='longctx' never materialises the attention probabilities, so output_attentions=True "
            "cannot be served; use attn_implementation='eager' to inspect attention weights"
        )
    if dropout:
        raise ValueError(
            f"attn_implementation='longctx' has no attention dropout, got dropout={dropout} "
            f"(config.attention_dropout={getattr(config, 'attention_dropout', None)}); set "
            f"config.attention_dropout=0.0 or {_SDPA_HINT}"
        )
    for name in ("s_aux", "sinks", "position_bias"):
        if kwargs.get(name) is not None:
            raise ValueError(
                f"attn_implementation='longctx' does not implement {name} (attention sinks/biases); {_SDPA_HINT}"
            )


def _window(w: int | None) -> tuple[int, int]:
    return (-1, -1) if w is None else (w - 1, 0)


def _plain_causal(q: torch.Tensor, k: torch.Tensor, causal: bool, window: int | None, softcap: float) -> bool:
    """Whether `kept_causal_attention` computes this call exactly: causal over one sequence (no KV cache), no
    window shorter than it, no softcap (padding and packed documents went to the varlen path before)."""
    S = k.shape[2]
    return causal and q.shape[2] == S and (window is None or window >= S) and not softcap


def _varlen_kwargs(kwargs: dict[str, Any]) -> _Varlen | None:
    keys = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
    vals = [kwargs.get(k) for k in keys]
    if all(v is None for v in vals):
        return None
    if any(v is None for v in vals):
        missing = [k for k, v in zip(keys, vals) if v is None]
        raise ValueError(f"packed sequences need all of {keys}; missing {missing} (DataCollatorWithFlattening "
                         "with return_flash_attn_kwargs=True passes all four)")  # fmt: skip
    cu_q, cu_k, max_q, max_k = vals
    return _Varlen(None, None, cu_q.to(torch.int32), cu_k.to(torch.int32), int(max_q), int(max_k))


def _run_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: _Varlen,
    *,
    causal: bool,
    window: int | None,
    scale: float | None,
    softcap: float = 0.0,
) -> torch.Tensor:
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    q_t = q.transpose(1, 2).reshape(B * Sq, Hq, D)  # (B*Sq, Hq, D)
    k_t = k.transpose(1, 2).reshape(B * Sk, Hkv, D)  # (B*Sk, Hkv, D)
    v_t = v.transpose(1, 2).reshape(B * Sk, Hkv, D)
    if meta.idx_k is not None:
        q_t, k_t, v_t = (
            q_t.index_select(0, meta.idx_q),
            k_t.index_select(0, meta.idx_k),
            v_t.index_select(0, meta.idx_k),
        )
    out = flash_attn_varlen_func(
        q_t, k_t, v_t, meta.cu_q, meta.cu_k, meta.max_q, meta.max_k,
        softmax_scale=scale, causal=causal, window_size=_window(window), softcap=softcap,
    )  # fmt: skip
    if meta.idx_q is not None:  # padded query rows stay 0
        out = out.new_zeros(B * Sq, Hq, out.shape[-1]).index_copy(0, meta.idx_q, out)
    return out.view(B, Sq, Hq, -1)  # (B, Sq, Hq, D)


def longctx_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: LongctxMask | torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention call for ``attn_implementation="longctx"`` (registered with AttentionInterface).

    Args:
        module: the attention module (its ``is_causal``; its context-parallel settings after `apply`).
        query: (B, Hq, Sq, D); key, value: (B, Hkv, Sk, D), Hq a multiple of Hkv.
        attention_mask: the `LongctxMask` of `longctx_mask`, or None (causal from ``is_causal`` / the module).
        dropout: must be 0.
        scaling: the softmax scale (default 1/sqrt(D)).
        sliding_window: the layer's window (transformers' convention); must agree with the mask's.
        softcap: attention logit softcapping (Gemma 2), None or 0 for none; not under context parallelism.
        is_causal: overrides ``module.is_causal`` when there is no mask.
        **kwargs: ``cu_seq_lens_q/k`` and ``max_length_q/k`` of packed batches; the rest is ignored.

    Returns:
        ``(out, None)``: out (B, Sq, Hq, D) in the inputs' dtype (the autocast dtype inside autocast); no weights.

    Raises:
        ValueError / TypeError: a feature longctx does not serve (see the module docstring), naming the alternative.
    """
    _unsupported(module, dropout, kwargs)
    cap = 0.0 if softcap is None else softcap
    if attention_mask is not None and not isinstance(attention_mask, LongctxMask):
        shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else None
        raise TypeError(
            f"attn_implementation='longctx' received a prepared attention mask ({type(attention_mask).__name__}, shape "
            f"{shape}): custom 4-D masks are not supported; pass a 2-D attention_mask (padding) or position_ids "
            f"(packing) to the model, or {_SDPA_HINT}"
        )
    if value.shape[-1] != query.shape[-1]:
        raise ValueError(
            f"attn_implementation='longctx' needs the value head dim ({value.shape[-1]}) equal to the query/key head "
            f"dim ({query.shape[-1]}); {_SDPA_HINT}"
        )
    mask = attention_mask
    causal = mask.causal if mask is not None else bool(is_causal if is_causal is not None else module.is_causal)
    window = mask.window if mask is not None else sliding_window
    if mask is not None and sliding_window is not None and sliding_window != mask.window:
        raise ValueError(
            f"the layer passes sliding_window={sliding_window} but its mask was built with window {mask.window}: the "
            f"model's attention and mask disagree; {_SDPA_HINT}"
        )
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    cp = getattr(module, "_longctx_context_parallel", None)
    if cp is not None:
        if cap:
            raise ValueError(
                f"context parallelism does not implement attention logit softcapping, got softcap={softcap}; "
                "run without context_parallel_group, or set config.attn_logit_softcapping=None (a different model)"
            )
        return _cp_attention(cp, query, key, value, mask, kwargs, causal=causal, window=window, scale=scale), None

    meta = _varlen_kwargs(kwargs)
    if meta is not None:
        if mask is not None and mask.padding is not None:
            raise ValueError(
                "a batch is either padded (attention_mask with zeros) or packed (cu_seq_lens_q/k), got both; "
                "DataCollatorWithFlattening returns no attention_mask: drop it"
            )
        if query.shape[2] != key.shape[2]:
            raise ValueError("packed sequences (cu_seq_lens_q/k) are for training: no KV cache")
    elif mask is not None and mask.varlen is not None:
        meta = mask.varlen
    elif isinstance(kwargs.get("position_ids"), torch.Tensor) and query.shape[2] == key.shape[2] > 1:
        # transformers looks for packed documents only without a KV cache (use_cache=False); a training forward
        # with the cache on still has restarting position ids, and documents must stay apart there too
        pos = kwargs["position_ids"]
        if pos.dim() == 2 and pos.shape[-1] == query.shape[2]:
            meta = _varlen_from_positions(pos, query.shape[0])
    if meta is not None:
        out = _run_varlen(query, key, value, meta, causal=causal, window=window, scale=scale, softcap=cap)
        return out, None
    if window is not None and not causal:
        raise ValueError(
            f"attn_implementation='longctx' implements sliding windows for causal attention only; {_SDPA_HINT}"
        )
    if getattr(module, "_longctx_keep_attention", False) and _plain_causal(query, key, causal, window, cap):
        out = kept_causal_attention(module, query, key, value, scale)  # None outside a recomputed chunk
        if out is not None:
            return out.transpose(1, 2), None  # (B, S, Hq, D)
    out = attention(
        query, key, value, causal=causal, window=_window(window) if window else None, scale=scale, softcap=cap
    )
    return out.transpose(1, 2), None  # (B, Sq, Hq, D)


def register() -> None:
    """Register ``"longctx"`` with transformers' AttentionInterface and AttentionMaskInterface (done on import)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, longctx_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, longctx_mask)


def _cp_attention(
    cp: ContextParallel,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: LongctxMask | None,
    kwargs: dict[str, Any],
    *,
    causal: bool,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    if mask is not None and mask.padding is not None:
        raise ValueError("context parallelism does not support padded rows (attention_mask with zeros)")
    plan = getattr(cp, "_packed_plan", None)
    if plan is not None:  # packed documents, dealt by the dispatcher: one launch per step over this rank's tokens
        if not causal or window is not None:
            raise ValueError(
                "context parallelism over packed documents runs causal attention without a sliding window; this "
                f"layer asks for causal={causal}, window={window}: train without packing or without the window"
            )
        q, k, v, run_ctx = follow_autocast(q, k, v)
        with run_ctx:
            out = plan.attention(*(t[0].transpose(0, 1) for t in (q, k, v)), method=cp.method, scale=scale,
                                 backend=cp.backend)  # fmt: skip
        return out.unsqueeze(0)  # (1, L, Hq, D)
    # the zigzag position ids make transformers see "packed documents" in every rank's shard: the shards are parts
    # of one sequence, and cp_attention applies the causal rule over global positions
    q, k, v, run_ctx = follow_autocast(q, k, v)
    with run_ctx:
        out = cp_attention(
            q, k, v, group=cp.group, method=cp.method, layout=cp.layout, causal=causal,
            window=_window(window) if window else None, scale=scale, backend=cp.backend,
        )  # fmt: skip
    return out.transpose(1, 2)  # (B, S/P, Hq, D)


register()
