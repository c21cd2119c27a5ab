"""longctx in HuggingFace transformers models: attention, padding-free packing, recomputation, the loss, CP.

Importing this module registers the attention implementation ``"longctx"`` with transformers'
``AttentionInterface`` (the attention call) and ``AttentionMaskInterface`` (the mask creation), so::

    import longctx.integrations.transformers as lt
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="longctx")
    lt.apply(model, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)

What the attention serves (causal LMs of the Llama family: Llama, Mistral, Qwen2/3, Gemma):

- GQA (K/V never repeated), the model's ``scaling``, its sliding window (transformers' window of ``w`` tokens,
  keys ``i - w < j <= i``, is longctx's ``window=(w - 1, 0)``);
- padding: a 2-D ``attention_mask`` with zeros; the real tokens of every row are packed and run through
  `longctx.flash_attn_varlen_func` (padded keys are never attended; padded query rows give 0);
- padding-free packing (``DataCollatorWithFlattening``): documents come from ``cu_seq_lens_q/k`` and
  ``max_length_q/k`` when the collator returns them, else from ``position_ids`` restarting (the rule transformers'
  own mask uses), and run through the varlen kernels: no token attends across a document boundary;
- attention logit softcapping (Gemma 2's ``softcap``, from ``config.attn_logit_softcapping``), passed to longctx's
  ``softcap`` (not under context parallelism);
- ``torch.autocast``: q, k, v are cast as SDPA casts them.

Everything else raises a ValueError/TypeError naming the feature and the alternative: attention weights
(``output_attentions``), attention dropout, attention sinks, position biases, custom 4-D
masks, mask overlays it does not implement (chunked attention, bidirectional image blocks, ``or_mask_function``).

`compile_ahead(model, max_seq_len, packed=...)` compiles, before training, the attention kernels the model's
config calls for (its heads, head dim, sliding-window layers and softcap), all at once in threads (`longctx.warmup`).

The mask interface returns a `LongctxMask` (what the model's mask asked for: causal or not, the window, the
padding or the packed documents, with the varlen metadata computed once per forward) instead of a dense mask;
every layer reads it.
"""

from __future__ import annotations

import math
import types
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
from transformers.modeling_outputs import CausalLMOutputWithPast

from longctx.api.core import attention, follow_autocast
from longctx.api.varlen import flash_attn_varlen_func
from longctx.distributed import ContextParallel, cp_attention
from longctx.distributed.comm import comm_device, group_info
from longctx.layers.loss import linear_cross_entropy
from longctx.layers.offload import ActivationOffloader, offloaded_checkpoint
from longctx.layers.recompute import checkpoint_call, plan_layers, recompute_active

__all__ = [
    "ATTN_IMPLEMENTATION",
    "LongctxMask",
    "longctx_attention_forward",
    "longctx_mask",
    "register",
    "apply",
    "allreduce_gradients",
    "compile_ahead",
    "FUSED_LOSS_MODELS",
]

ATTN_IMPLEMENTATION = "longctx"

# Causal LMs whose forward is `logits = lm_head(model(...).last_hidden_state)` then ForCausalLMLoss, so the loss
# can be computed from the hidden states (Gemma2/3 only without final_logit_softcapping).
FUSED_LOSS_MODELS = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "GemmaForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
)

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
    out = attention(
        query, key, value, causal=causal, window=_window(window) if window else None, scale=scale, softcap=cap
    )
    return out.transpose(1, 2), None  # (B, Sq, Hq, D)


def register() -> None:
    """Register ``"longctx"`` with transformers' AttentionInterface and AttentionMaskInterface (done on import)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, longctx_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, longctx_mask)


register()


# -- apply: recomputation, offloading, the loss, context parallelism --------------------------------------------


def _decoder(model: nn.Module) -> nn.Module:
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    if base is None or not isinstance(getattr(base, "layers", None), nn.ModuleList):
        raise TypeError(
            f"apply expects a causal LM whose base model holds its decoder layers in `.layers` (the Llama family), "
            f"got {type(model).__name__}"
        )
    return base


def _check_output(h: object, layer: nn.Module) -> torch.Tensor:
    if not isinstance(h, torch.Tensor):
        raise TypeError(
            f"{type(layer).__name__} returned {type(h).__name__}; layer recomputation needs decoder layers that return "
            "the hidden states tensor"
        )
    return h


def _patch_layers(
    layers: nn.ModuleList, chunks: list, offloader: ActivationOffloader | None, offload_layers: int
) -> None:
    """Megatron-semantics recomputation on transformers' layer loop: the first layer of a checkpointed chunk runs
    the whole chunk under a checkpoint, the others of the chunk pass the hidden states through (in training with
    autograd recording; otherwise every layer runs as it was)."""
    for c in chunks:
        if not c.checkpointed:
            continue
        members = [layers[i] for i in range(c.start, c.end)]
        for layer in members:
            if not hasattr(layer, "_longctx_forward"):
                layer._longctx_forward = layer.forward
        head = members[0]

        def head_forward(self, hidden_states, *args, _c=c, _members=members, **kwargs):
            if not recompute_active(self):
                return self._longctx_forward(hidden_states, *args, **kwargs)
            if _c.end - _c.start > 1 and _collecting("hidden_states"):
                raise ValueError(
                    "output_hidden_states cannot report the layers inside a recomputed chunk of "
                    f"{_c.end - _c.start} layers; use recompute_num_layers=1 (or method 'block') to collect them"
                )
            # the KV cache is for generation: a recomputed layer would write it twice (transformers' own
            # gradient checkpointing drops it the same way)
            kwargs = {**kwargs, "use_cache": False, "past_key_values": None} if "past_key_values" in kwargs else kwargs

            def run(h: torch.Tensor) -> torch.Tensor:
                for m in _members:
                    h = _check_output(m._longctx_forward(h, *args, **kwargs), m)
                return h

            if offloader is None:
                return checkpoint_call(run, hidden_states)
            grads = [n for n, t in kwargs.items() if isinstance(t, torch.Tensor) and t.requires_grad]
            grads += [n for n, t in kwargs.items() if isinstance(t, tuple) and any(
                isinstance(x, torch.Tensor) and x.requires_grad for x in t)]  # fmt: skip
            if grads or any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
                raise ValueError(
                    f"cpu_offloading needs layer inputs other than the hidden states without gradients, got {grads}"
                )
            if _c.start == 0:
                offloader.begin()
            return offloaded_checkpoint(run, offloader, _c.end <= offload_layers, hidden_states)

        def pass_forward(self, hidden_states, *args, **kwargs):
            if recompute_active(self):
                return hidden_states  # computed by the chunk's first layer
            return self._longctx_forward(hidden_states, *args, **kwargs)

        head.forward = types.MethodType(head_forward, head)
        for layer in members[1:]:
            layer.forward = types.MethodType(pass_forward, layer)


def _shift_labels(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]  # (B, S): token t predicts labels[t + 1]


def _token_loss_sum(model: nn.Module, hidden: torch.Tensor, shift: torch.Tensor, fused: bool) -> torch.Tensor:
    head = model.get_output_embeddings()
    if fused:
        return linear_cross_entropy(hidden, head.weight, shift, bias=head.bias, reduction="sum")
    logits = head(hidden).float()  # (B, S, V)
    return F.cross_entropy(logits.flatten(0, 1), shift.flatten(), ignore_index=-100, reduction="sum")


def _patch_forward(model: nn.Module, *, fused_loss: bool, cp: ContextParallel | None) -> None:
    original = model.forward
    base = _decoder(model)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Any = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Any,
    ):
        shift = kwargs.pop("shift_labels", None)
        num_items = kwargs.pop("num_items_in_batch", None)
        return_dict = kwargs.pop("return_dict", True)
        if cp is None and labels is None and shift is None:
            return original(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                logits_to_keep=logits_to_keep, return_dict=return_dict, **kwargs,
            )  # fmt: skip
        if shift is None and labels is not None:
            shift = _shift_labels(labels)
        if cp is not None:
            varlen = {k: kwargs.pop(k) for k in _VARLEN_KEYS if k in kwargs}  # this rank's tokens are others
            input_ids, inputs_embeds, position_ids, shift = _cp_inputs(
                cp, input_ids, inputs_embeds, attention_mask, position_ids, past_key_values, shift, varlen
            )
            attention_mask, use_cache = None, False
        outputs = base(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs,
        )  # fmt: skip
        hidden = outputs.last_hidden_state  # (B, S, h), this rank's S/P under context parallelism
        loss, logits = None, None
        if shift is None:  # context parallelism without labels: this rank's logits
            logits = self.get_output_embeddings()(hidden)
        else:
            local_sum = _token_loss_sum(self, hidden, shift, fused_loss)
            if cp is not None:
                loss = _cp_loss(cp, local_sum, shift, num_items)
            elif num_items is not None:
                loss = local_sum / torch.as_tensor(num_items, device=local_sum.device)
            else:
                loss = local_sum / (shift != -100).sum()
        out = CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )
        return out if return_dict else out.to_tuple()

    model.forward = types.MethodType(forward, model)


_VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def _cp_inputs(
    cp: ContextParallel,
    input_ids: torch.Tensor | None,
    inputs_embeds: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    past_key_values: Any,
    shift: torch.Tensor | None,
    varlen: dict[str, Any],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """This rank's shard of the full-batch inputs and shifted labels, and its positions.

    One sequence per row: the zigzag shard of every row, with global positions. Packed documents (position ids
    that restart, or the flattening collator's cu_seq_lens): the rows packed end to end and dealt by the dispatcher
    (`longctx.distributed.dispatch_plan`: documents whole where they fit, balanced by mask area), each tensor
    (1, B S / P) with positions inside the documents; the plan stays on ``cp`` (``_packed_plan``) for the layers'
    attention, and for their recomputation in the backward, until the next forward."""
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError(
            "context parallelism shards one unpadded sequence per row: got an attention_mask with padding; pack "
            "or trim the batch to full rows"
        )
    if past_key_values is not None:
        raise ValueError("context parallelism is for training: pass past_key_values=None")
    full = input_ids if input_ids is not None else inputs_embeds
    B, S = full.shape[:2]
    meta = _varlen_kwargs(varlen)
    if meta is None and position_ids is None:
        cp._packed_plan = None
        cp.check_seq_len(S)
        pos = cp.position_ids(S, device=full.device).unsqueeze(0).expand(B, -1)  # (B, S/P)
        return cp.shard(input_ids), cp.shard(inputs_embeds), pos, cp.shard(shift)
    from longctx.distributed.dispatch import dispatch_plan
    from longctx.masks.packing import document_positions, packed_cu_seqlens

    if meta is not None:  # the collator's documents, over the rows packed end to end
        if meta.cu_q.tolist() != meta.cu_k.tolist() or int(meta.cu_q[-1]) != B * S:
            raise ValueError(
                "context parallelism over packed documents needs cu_seq_lens_q == cu_seq_lens_k covering the batch's "
                f"{B * S} tokens (DataCollatorWithFlattening's), got {meta.cu_q.tolist()} and {meta.cu_k.tolist()}"
            )
        starts = torch.zeros(B * S, dtype=torch.bool, device=full.device)
        starts[meta.cu_q[:-1].long().to(full.device)] = True
        starts = starts.view(B, S)
    else:
        starts = position_ids.expand(B, S) == 0  # the documents start where the positions restart
    pos = document_positions(starts)  # (B, S)
    plan = dispatch_plan(packed_cu_seqlens(starts).tolist(), group=cp.group, causal=True)
    cp._packed_plan = plan

    def local(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else plan.dispatch(t.reshape(B * S, *t.shape[2:])).unsqueeze(0)

    return local(input_ids), local(inputs_embeds), local(pos), local(shift)


def _cp_loss(cp: ContextParallel, local_sum: torch.Tensor, shift: torch.Tensor, num_items: Any) -> torch.Tensor:
    """This rank's share of the global mean, whose value is the global mean itself (for logging)."""
    if num_items is None:
        share, mean = cp.share_of_mean(local_sum, (shift != -100).sum())
    else:  # the Trainer's count of the labels over the (full, identical on every rank) batch
        denom = torch.as_tensor(num_items, device=local_sum.device).to(local_sum.dtype)
        share = local_sum / denom
        total = local_sum.detach().clone()
        if cp.world > 1:
            info = group_info(cp.group)
            total = total.to(comm_device(info, local_sum))
            torch.distributed.all_reduce(total, group=cp.group)
        mean = total.to(local_sum.device) / denom
    return share + (mean.to(share.dtype) - share).detach()


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


def apply(
    model: nn.Module,
    *,
    recompute_granularity: str | None = None,
    recompute_method: str | None = None,
    recompute_num_layers: int | None = None,
    cpu_offloading: bool = False,
    cpu_offloading_num_layers: int | None = None,
    fused_loss: bool = True,
    context_parallel_group: Any = None,
    context_parallel_method: str = "ring",
    context_parallel_layout: str = "zigzag",
    context_parallel_backend: str = "auto",
    offload_params: bool = False,
    mesh: Any = None,
) -> nn.Module:
    """Put longctx into a transformers causal LM, in place (Liger-Kernel's ``apply_liger_kernel_to_*`` idea).

    The model may be wrapped by PEFT (``get_peft_model(model, LoraConfig(...))``): longctx goes into the causal LM
    inside, the adapters stay where PEFT put them (only they train; the frozen base is neither copied nor given
    gradients).

    - attention: switched to ``attn_implementation="longctx"``;
    - recomputation with Megatron's semantics (`longctx.layers.recompute`) over the decoder layers: "full" with
      "uniform" (chunks of ``recompute_num_layers`` layers, each keeping only its input) or "block" (the first
      ``recompute_num_layers`` layers); "selective" places nothing (longctx's attention already recomputes its
      scores in the backward);
    - ``cpu_offloading``: the inputs the recomputed chunks keep go to pinned host memory (the first
      ``cpu_offloading_num_layers`` layers, default all), as `longctx.GPT` does;
    - ``fused_loss``: with ``labels``, the loss comes from the hidden states through `longctx.linear_cross_entropy`
      without the (tokens, vocab) logits; the output's ``logits`` is then None. Same value as transformers'
      ForCausalLMLoss (mean over counted tokens, or the sum over ``num_items_in_batch`` as the Trainer passes);
    - context parallelism (``context_parallel_group``): every rank calls the model with the same full batch
      (B, S); the model shards input ids, labels and positions (``context_parallel_layout``, zigzag by default),
      runs `longctx.distributed.cp_attention` in every layer, and returns a loss whose value is the global mean
      and whose gradient is this rank's share: call `allreduce_gradients(model)` after ``backward`` to get the
      single-process gradients. Without labels it returns this rank's logits (B, S/P, V). Packed batches
      (DataCollatorWithFlattening: cu_seq_lens, or position ids that restart) are packed end to end and dealt by
      `longctx.distributed.dispatch_plan` (documents whole where they fit, balanced by mask area; causal, no
      sliding window), ``context_parallel_method`` running over the plan;
    - ``offload_params``: the parameters, their gradients and the optimizer's states in host memory, sharded by FSDP2
      over ``mesh`` (`longctx.distributed.offload`; None: this process alone): build the optimizer after ``apply``,
      on the host (`longctx.distributed.offload.host_adamw`). With context parallelism, ``mesh`` is
      ``init_mesh(dp, cp)`` and ``context_parallel_group`` its "cp" group: FSDP2 then sums the gradients over both
      and `allreduce_gradients` has nothing to do.

    Args:
        model: a causal LM of the Llama family (``model.model.layers``).
        recompute_granularity, recompute_method, recompute_num_layers: as in Megatron (see
            `longctx.layers.recompute`).
        cpu_offloading, cpu_offloading_num_layers: activation offloading of fully recomputed layers.
        fused_loss: the logits-free loss (models in `FUSED_LOSS_MODELS`).
        context_parallel_group: a process group (or the default world when the ``torch.distributed`` world is the
            group: pass ``torch.distributed.group.WORLD``); None for no context parallelism.
        context_parallel_method: "ring", "allgather" or "ulysses". context_parallel_layout: "zigzag" or
            "contiguous". context_parallel_backend: "auto", "tiled" or "triton".
        offload_params: parameters, gradients and optimizer states in host memory (FSDP2's CPU offload).
        mesh: the ("dp", "cp") DeviceMesh of `longctx.distributed.init_mesh` the offloaded states are sharded over
            (with ``offload_params`` only).

    Returns:
        The same model.

    Raises:
        ValueError / TypeError: invalid recompute settings (Megatron's rules), offloading without full
            recomputation, transformers' own gradient checkpointing left on, fused_loss on a model whose loss is
            not `lm_head` + cross-entropy (e.g. final logit softcapping), a model that is not a causal LM of the
            Llama family, or attention dropout with context parallelism.
    """
    wrapper = model
    if getattr(wrapper, "_longctx_applied", False):
        raise ValueError("apply was already called on this model; build a fresh model to change the settings")
    if callable(getattr(model, "get_base_model", None)):  # PEFT's PeftModel: longctx goes into the causal LM inside
        model = model.get_base_model()
    base = _decoder(model)
    layers = base.layers
    cfg = model.config
    if getattr(model, "_longctx_applied", False):
        raise ValueError("apply was already called on this model; build a fresh model to change the settings")
    if not isinstance(offload_params, bool):
        raise TypeError(f"offload_params must be True or False, got {offload_params!r}")
    if mesh is not None and not offload_params:
        raise ValueError("mesh is where offload_params shards the states: pass offload_params=True, or no mesh")
    if offload_params and context_parallel_group is not None and mesh is None:
        raise ValueError(
            "offload_params with context parallelism shards the states over the data x context parallel ranks: pass "
            "mesh=init_mesh(dp, cp) and its cp group (longctx.distributed.cp_group(mesh)) as context_parallel_group"
        )
    if getattr(model, "is_gradient_checkpointing", False) and recompute_granularity is not None:
        raise ValueError(
            "transformers' gradient checkpointing is on (gradient_checkpointing_enable() or TrainingArguments("
            "gradient_checkpointing=True)); turn it off when apply places longctx's recomputation"
        )
    chunks = plan_layers(recompute_granularity, recompute_method, recompute_num_layers, len(layers))
    if not isinstance(cpu_offloading, bool) or not isinstance(fused_loss, bool):
        raise TypeError(f"cpu_offloading and fused_loss must be bools, got {cpu_offloading!r}, {fused_loss!r}")
    if cpu_offloading and recompute_granularity != "full":
        raise ValueError(
            "cpu_offloading moves the inputs of fully recomputed layers to host memory: set "
            f"recompute_granularity='full' (got {recompute_granularity!r})"
        )
    n_off = len(layers) if cpu_offloading_num_layers is None else cpu_offloading_num_layers
    if isinstance(n_off, bool) or not isinstance(n_off, int) or not 1 <= n_off <= len(layers):
        raise ValueError(
            f"cpu_offloading_num_layers must be an int in [1, {len(layers)}] or None, got {cpu_offloading_num_layers!r}"
        )
    if fused_loss:
        name = type(model).__name__
        if name not in FUSED_LOSS_MODELS:
            raise ValueError(
                f"fused_loss=True computes the loss of {', '.join(FUSED_LOSS_MODELS)} without logits; {name} may "
                "transform its logits before the loss: pass fused_loss=False"
            )
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if head is not None and hasattr(head, "lora_A"):
            raise ValueError(
                "the logits-free loss reads lm_head's weight, but PEFT put an adapter on lm_head: leave lm_head out of "
                "the adapter's target_modules, or pass fused_loss=False"
            )
        softcap = getattr(cfg, "final_logit_softcapping", None)
        if softcap is not None:
            raise ValueError(
                f"{name} caps its logits (config.final_logit_softcapping={softcap}), which the logits-free loss does "
                "not implement: pass fused_loss=False, or set final_logit_softcapping=None"
            )
    cp = None
    if context_parallel_group is not None:
        if getattr(cfg, "attention_dropout", 0.0):
            raise ValueError("context parallelism needs config.attention_dropout == 0")
        group = None if context_parallel_group is torch.distributed.group.WORLD else context_parallel_group
        cp = ContextParallel(
            group=group,
            method=context_parallel_method,
            layout=context_parallel_layout,
            backend=context_parallel_backend,
        )
        if context_parallel_method == "ulysses":
            from longctx.distributed.ulysses import kv_replication

            kv_replication(cfg.num_attention_heads, cfg.num_key_value_heads, cp.world)
        for layer in layers:
            layer.self_attn._longctx_context_parallel = cp
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    else:  # pragma: no cover - transformers without set_attn_implementation
        cfg._attn_implementation = ATTN_IMPLEMENTATION
    offloader = ActivationOffloader() if cpu_offloading else None
    _patch_layers(layers, chunks, offloader, n_off)
    if fused_loss or cp is not None:
        _patch_forward(model, fused_loss=fused_loss, cp=cp)
    if offload_params:
        from longctx.distributed.offload import offload_model

        offload_model(model, mesh)
    for m in {id(model): model, id(wrapper): wrapper}.values():
        m._longctx_applied = True
        m._longctx_context_parallel = None if offload_params else cp  # offloaded: FSDP2 summed over dp x cp
    return wrapper


def compile_ahead(
    model: nn.Module,
    max_seq_len: int,
    *,
    packed: bool = False,
    dtype: torch.dtype | None = None,
    workers: int | None = None,
):
    """Compile, before training, the attention kernels a transformers model calls with ``attn_implementation=
    "longctx"``, all at once in threads (`longctx.warmup`), for every length bucket up to ``max_seq_len``; they land
    in Triton's on-disk cache too, so later runs on the machine only load them.

    The attention's shape comes from the model's config: heads, key/value heads, head dim, the logit softcap
    (``attn_logit_softcapping``) and which layers use the sliding window (``layer_types``, else every layer when
    ``sliding_window`` is set). Under context parallelism (`apply` with a group) the ranks call the kernels on their
    chunks, which this does not warm.

    Args:
        model: a causal LM on a CUDA device.
        max_seq_len: the longest sequence of a batch; with ``packed``, the most tokens in one batch.
        packed: batches that are padded (an ``attention_mask`` with zeros) or packed (``DataCollatorWithFlattening``),
            which run through `longctx.flash_attn_varlen_func`; False: full rows of one length.
        dtype: the attention's dtype (default: the model's when it is bf16 or fp16, else bf16, as under autocast).
        workers: compile threads (default: one per CPU core).

    Returns:
        The `longctx.warmup.WarmupReport`.

    Raises:
        ValueError / TypeError: a model that is not on a CUDA device, or settings `longctx.warmup` rejects.
    """
    from longctx.warmup import warmup

    if not isinstance(packed, bool):
        raise TypeError(f"packed must be a bool, got {packed!r}")
    param = next(model.parameters())
    if param.device.type != "cuda":
        raise ValueError(
            f"compile_ahead compiles GPU kernels: move the model to a CUDA device first (it is on {param.device})"
        )
    if dtype is None:
        dtype = param.dtype if param.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    return warmup(
        **_attention_shape(model.config, packed),
        dtype=dtype,
        max_seq_len=max_seq_len,
        device=param.device,
        workers=workers,
    )


def _attention_shape(config: Any, packed: bool) -> dict[str, Any]:
    """`longctx.warmup`'s description of a transformers config's attention: head dim, heads, key/value heads, the
    masks its layers use (causal, and the sliding window where ``layer_types`` or ``sliding_window`` says; packed
    documents instead with ``packed``), the window in longctx's convention and the logit softcap."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = cfg.num_attention_heads
    window = getattr(cfg, "sliding_window", None)
    kinds = set(getattr(cfg, "layer_types", None) or ["sliding_attention" if window else "full_attention"])
    sliding = "sliding_attention" in kinds and bool(window)
    masks = []
    if kinds - {"sliding_attention"} or not sliding:
        masks.append("documents" if packed else "causal")
    if sliding:
        masks.append("documents_window" if packed else "window")
    return dict(
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        n_heads=heads,
        n_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        masks=masks,
        window=window - 1 if sliding else None,  # transformers' window of w tokens: keys i - w < j <= i
        softcap=float(getattr(cfg, "attn_logit_softcapping", None) or 0.0),
    )


def allreduce_gradients(model: nn.Module) -> None:
    """Sum the parameter gradients over the context-parallel group of a model `apply` set up for it (after
    ``loss.backward()``, before the optimizer step); nothing without context parallelism."""
    cp = getattr(model, "_longctx_context_parallel", None)
    if cp is not None:
        cp.allreduce_gradients(model)
