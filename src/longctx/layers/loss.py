"""The output projection and cross-entropy in one, over chunks of tokens: a loss that never holds the logits.

    loss = cross_entropy(hidden @ weight.T (+ bias), labels)        hidden (N, h), weight (V, h), labels (N,)

A language model's loss at long S is dominated by the (tokens, vocab) logits: at S = 64K and a 32K vocabulary they
are 8 GiB in float32 (4 GiB in bf16), and `F.cross_entropy` keeps a float32 copy plus its gradient of the same size.
Here the tokens are processed in chunks: per chunk, the logits are computed, reduced to the per-token loss with a
float32 log-sum-exp, and, when a gradient will be needed, turned into the chunk's gradients right away (softmax minus
the one-hot target, times the token's weight), so that the backward only scales the stored gradients by the
incoming scalar (Liger-Kernel's fused linear cross-entropy does the same). Peak extra memory is one chunk's
logits, its softmax and the float32 weight gradient, never (N, V).

``reduction="none"`` returns per-token losses whose gradients are not a scalar multiple of anything stored: that
path saves the inputs and the per-token log-sum-exp and recomputes each chunk's logits in the backward.

Autocast: inside a `torch.autocast` region the matmuls run in the autocast dtype, as `F.linear` would, and the
log-sum-exp, the loss and the accumulated weight gradient in float32, as `F.cross_entropy` would; float64 inputs
are computed in float64 throughout (the tests' oracle).
"""

from __future__ import annotations

import torch

from longctx.dtypes import accumulation_dtype

__all__ = ["linear_cross_entropy", "default_chunk_size"]

_REDUCTIONS = ("mean", "sum", "none")


def default_chunk_size(num_tokens: int, hidden_size: int, vocab_size: int) -> int:
    """Tokens per chunk: a power of two whose logits are about as large as the hidden states (at least 256 tokens,
    so the matmuls stay large enough to run at full speed, at most every token)."""
    target = max(1, num_tokens * hidden_size // max(1, vocab_size))
    chunk = 1 << max(8, (target - 1).bit_length())
    return max(1, min(num_tokens, chunk))


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    if t.dtype == torch.float64:
        return torch.float64
    if torch.is_autocast_enabled(t.device.type):
        return torch.get_autocast_dtype(t.device.type)
    return t.dtype


def _chunk_logits(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, acc: torch.dtype) -> torch.Tensor:
    z = h @ w.t()  # (c, V) in the compute dtype
    if b is not None:
        z = z + b
    return z.to(acc)  # (c, V) float32 (float64 for float64 inputs)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, token_weight, chunk: int, reduction: str):
        # hidden (N, h); weight (V, h); bias (V,) or None; labels (N,) int64 with ignored tokens already at 0;
        # token_weight (N,) float: 0 for tokens that do not count, 1 / count for "mean", 1 for "sum" and "none"
        cdt = _compute_dtype(hidden)
        acc = accumulation_dtype(cdt)
        N = hidden.shape[0]
        h_c = hidden.to(cdt)
        w_c = weight.to(cdt)
        b_c = None if bias is None else bias.to(cdt)
        needs_grad = any(ctx.needs_input_grad[:3])
        eager_grads = needs_grad and reduction != "none"

        loss = torch.empty(N, device=hidden.device, dtype=acc)  # per token, before weighting
        lse = torch.empty(N, device=hidden.device, dtype=acc) if reduction == "none" else None
        grad_h = torch.empty_like(hidden) if eager_grads and ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, device=weight.device, dtype=acc) if eager_grads else None
        with_b = eager_grads and bias is not None
        grad_b = torch.zeros(weight.shape[0], device=weight.device, dtype=acc) if with_b else None

        for s in range(0, N, chunk):
            e = min(N, s + chunk)
            z = _chunk_logits(h_c[s:e], w_c, b_c, acc)  # (c, V)
            lse_c = torch.logsumexp(z, dim=-1)  # (c,)
            target = z.gather(1, labels[s:e, None]).squeeze(1)  # (c,)
            loss[s:e] = lse_c - target
            if lse is not None:
                lse[s:e] = lse_c
            if eager_grads:
                # d loss_i / d z_i = softmax(z_i) - onehot(label_i), times the token's weight
                g = torch.exp_(z.sub_(lse_c[:, None]))  # (c, V): the softmax, in place of the logits
                g[torch.arange(e - s, device=g.device), labels[s:e]] -= 1.0
                g.mul_(token_weight[s:e, None].to(acc))
                g_c = g.to(cdt)
                if grad_h is not None:
                    grad_h[s:e] = (g_c @ w_c).to(hidden.dtype)  # (c, h)
                grad_w += (g_c.t() @ h_c[s:e]).to(acc)  # (V, h)
                if grad_b is not None:
                    grad_b += g.sum(0)
                del g, g_c
            del z

        weighted = loss * token_weight.to(acc)
        out = weighted if reduction == "none" else weighted.sum()
        if eager_grads:
            ctx.save_for_backward(grad_h, grad_w, grad_b)
        elif needs_grad:
            ctx.save_for_backward(hidden, weight, bias, labels, token_weight, lse)
        ctx.eager, ctx.chunk, ctx.cdt = eager_grads, chunk, cdt
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        h_dt, w_dt, b_dt = ctx.dtypes
        if ctx.eager:
            grad_h, grad_w, grad_b = ctx.saved_tensors
            scale = grad_out.to(grad_w.dtype)  # a scalar
            dh = None if grad_h is None else grad_h * scale.to(h_dt)
            dw = (grad_w * scale).to(w_dt)
            db = None if grad_b is None else (grad_b * scale).to(b_dt)
            return dh, dw, db, None, None, None, None
        # reduction="none": recompute each chunk's logits, d loss_i / d z_i = (softmax - onehot) * w_i * g_i
        hidden, weight, bias, labels, token_weight, lse = ctx.saved_tensors
        cdt, acc = ctx.cdt, lse.dtype  # the forward's compute dtype (autocast need not be active here)
        h_c, w_c = hidden.to(cdt), weight.to(cdt)
        b_c = None if bias is None else bias.to(cdt)
        scale = grad_out.to(acc) * token_weight.to(acc)  # (N,)
        dh = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        dw = torch.zeros(weight.shape, device=weight.device, dtype=acc)
        db = torch.zeros(weight.shape[0], device=weight.device, dtype=acc) if bias is not None else None
        N = hidden.shape[0]
        for s in range(0, N, ctx.chunk):
            e = min(N, s + ctx.chunk)
            z = _chunk_logits(h_c[s:e], w_c, b_c, acc)
            g = torch.exp_(z.sub_(lse[s:e, None]))
            g[torch.arange(e - s, device=g.device), labels[s:e]] -= 1.0
            g.mul_(scale[s:e, None])
            g_c = g.to(cdt)
            if dh is not None:
                dh[s:e] = (g_c @ w_c).to(h_dt)
            dw += (g_c.t() @ h_c[s:e]).to(acc)
            if db is not None:
                db += g.sum(0)
        return dh, dw.to(w_dt), None if db is None else db.to(b_dt), None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    loss_mask: torch.Tensor | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias), labels)`` without ever holding the (tokens, vocab) logits.

    Args:
        hidden: (..., h) floating point, e.g. a model's final hidden states (B, S, h).
        weight: (V, h), the output projection (an untied output layer or the tied embedding).
        labels: (...) integer class indices in [0, V), the same leading shape as ``hidden``; ``ignore_index``
            marks tokens that do not count.
        bias: optional (V,).
        ignore_index: label value of tokens that carry no loss and no gradient.
        reduction: "mean" (over the counted tokens; NaN when none counts, as `F.cross_entropy`), "sum", or
            "none" (per-token losses of shape ``labels.shape``, 0 on tokens that do not count).
        loss_mask: optional (...) bool or 0/1 tensor, the same shape as ``labels``: only tokens where it is
            nonzero count (combined with ``ignore_index``). "mean" then divides by the number of counted tokens.
        chunk_size: tokens per chunk; default `default_chunk_size` (logits per chunk about the size of hidden).

    Returns:
        The loss: a scalar float32 (float64 for float64 inputs) for "mean" / "sum", else per-token losses.

    Raises:
        TypeError / ValueError: on tensors of the wrong type, dtype or shape, labels out of range, an unknown
        reduction or a chunk size below 1.
    """
    _check(hidden, weight, labels, bias, reduction, loss_mask, chunk_size)
    lead = labels.shape
    h2 = hidden.reshape(-1, hidden.shape[-1])  # (N, h)
    y = labels.reshape(-1).long()  # (N,)
    N = y.shape[0]
    counted = y != ignore_index
    if loss_mask is not None:
        counted = counted & (loss_mask.reshape(-1) != 0)
    # (shape-only tensors, as the memory model traces with, have no values to check)
    if _has_values(y) and bool(((y < 0) | (y >= weight.shape[0])).logical_and(counted).any()):
        bad = y[counted & ((y < 0) | (y >= weight.shape[0]))][0].item()
        raise ValueError(
            f"labels must lie in [0, {weight.shape[0]}) (the vocabulary size) or equal ignore_index={ignore_index}; "
            f"got {bad}"
        )
    acc = accumulation_dtype(hidden.dtype)
    token_weight = counted.to(acc)
    if reduction == "mean":
        token_weight = token_weight / counted.sum().to(acc)  # NaN weights when nothing counts, as F.cross_entropy
    y = torch.where(counted, y, torch.zeros_like(y))
    if N == 0:
        zero = hidden.new_zeros((), dtype=acc) + 0.0 * weight.sum().to(acc)
        return zero.expand(lead).clone() if reduction == "none" else (zero / 0.0 if reduction == "mean" else zero)
    chunk = chunk_size or default_chunk_size(N, hidden.shape[-1], weight.shape[0])
    out = _LinearCrossEntropy.apply(h2, weight, bias, y, token_weight, int(chunk), reduction)
    return out.reshape(lead) if reduction == "none" else out


def _has_values(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return t.device.type != "meta" and not is_fake(t)


def _check(hidden, weight, labels, bias, reduction, loss_mask, chunk_size) -> None:
    for name, t in (("hidden", hidden), ("weight", weight), ("labels", labels)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not hidden.is_floating_point() or not weight.is_floating_point():
        raise TypeError(f"hidden and weight must be floating point, got {hidden.dtype} and {weight.dtype}")
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise TypeError(f"labels must be an integer tensor of class indices, got {labels.dtype}")
    if weight.dim() != 2 or hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"expected hidden (..., h) and weight (V, h) with the same h; got hidden {tuple(hidden.shape)} and "
            f"weight {tuple(weight.shape)}"
        )
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(
            f"labels must have hidden's leading shape {tuple(hidden.shape[:-1])}, got {tuple(labels.shape)}"
        )
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != (weight.shape[0],)):
        got = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
        raise ValueError(f"bias must be a tensor of shape ({weight.shape[0]},), got {got}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if loss_mask is not None and (not isinstance(loss_mask, torch.Tensor) or loss_mask.shape != labels.shape):
        got = tuple(loss_mask.shape) if isinstance(loss_mask, torch.Tensor) else type(loss_mask).__name__
        raise ValueError(f"loss_mask must be a tensor of labels' shape {tuple(labels.shape)}, got {got}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
