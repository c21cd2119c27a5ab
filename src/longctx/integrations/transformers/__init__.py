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

from longctx.integrations.transformers.apply import FUSED_LOSS_MODELS, allreduce_gradients, apply
from longctx.integrations.transformers.attention import (
    ATTN_IMPLEMENTATION,
    LongctxMask,
    longctx_attention_forward,
    longctx_mask,
    register,
)
from longctx.integrations.transformers.warmup import _attention_shape, compile_ahead  # noqa: F401 (tests read it)

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
