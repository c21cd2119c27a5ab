"""`compile_ahead`: the attention kernels a transformers model calls, compiled before training (`longctx.warmup`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["compile_ahead"]


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
