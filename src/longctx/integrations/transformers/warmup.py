"""`compile_ahead`: the attention kernels a transformers model calls, compiled before training (`longctx.warmup`), and
the position-wise kernels `apply` put into its layers."""

from __future__ import annotations

import time
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
    "longctx"``, all at once in threads (`longctx.warmup`), for every length bucket up to ``max_seq_len``, and the
    position-wise kernels of the RMSNorms and MLPs `apply` fused (recorded from the first layer's on stand-in
    inputs); they land in Triton's on-disk cache too, so later runs on the machine only load them.

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
    report = warmup(
        **_attention_shape(model.config, packed),
        dtype=dtype,
        max_seq_len=max_seq_len,
        device=param.device,
        workers=workers,
    )
    t0 = time.perf_counter()
    report.kernels += _compile_pointwise(model, max_seq_len, dtype, param.device, workers)
    report.compile_s += time.perf_counter() - t0
    return report


def _compile_pointwise(
    model: nn.Module, tokens: int, dtype: torch.dtype, device: torch.device, workers: int | None
) -> list[tuple[str, float, str]]:
    """The position-wise kernels (`longctx.ops.pointwise`) of the first decoder layer's fused RMSNorms and MLP
    (those `apply` patched): their launches recorded from a forward and backward of them on a stand-in sequence of
    256 tokens (the kernels are not specialised on token counts: one binary serves every length), in the residual
    stream's dtype under ``dtype`` autocast, with gradients for what trains; then compiled concurrently."""
    from longctx.integrations.transformers.apply import _decoder, _fusable
    from longctx.launchers.runtime import compile_ahead as record
    from longctx.launchers.runtime import compile_launches

    inner = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    if not getattr(inner, "_longctx_applied", False):  # nothing fused
        return []
    try:
        layer = _decoder(inner).layers[0]
    except (TypeError, IndexError):
        return []
    norms, mlps = _fusable(layer)
    if not norms and not mlps:
        return []
    hidden = inner.get_input_embeddings()
    stream = hidden.weight.dtype if hidden is not None else next(inner.parameters()).dtype
    cfg = inner.config.get_text_config() if hasattr(inner.config, "get_text_config") else inner.config
    trainable = [p for m in (*norms, *mlps) for p in m.parameters() if p.requires_grad]
    x = torch.zeros(1, min(256, tokens), cfg.hidden_size, dtype=stream, device=device, requires_grad=True)
    with record() as launches:
        with torch.autocast(device.type, dtype=dtype):
            outs = [m(x) for m in norms] + [m(norms[-1](x) if norms else x) for m in mlps]
        loss = sum(o.float().sum() for o in outs)
        torch.autograd.grad(loss, [x, *trainable])  # returned, not accumulated into .grad
    return compile_launches(launches, device, workers)


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
