"""The public attention functions: `attention`, `flash_attn_func` and `explain`."""

from __future__ import annotations

import contextlib
import math
import numbers

import torch

from longctx.dispatch import AttnInputs, BackendChoice, get_backend, select_backend
from longctx.masks import Band, BlockMask, flash_window

__all__ = [
    "attention",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "explain",
    "follow_autocast",
]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        raise ValueError(
            f"{name} must have 4 dimensions (batch, heads, seq, head_dim), got shape {tuple(t.shape)}; "
            "for the (batch, seq, heads, head_dim) layout use longctx.flash_attn_func"
        )
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; expected one of float16, bfloat16, float32, float64")
    return t


# Device types with an autocast mode, found once at import: torch.compile cannot trace the availability query itself.
_AUTOCAST_DEVICES = frozenset(
    d for d in ("cpu", "cuda", "xpu", "mps", "hpu", "mtia", "xla", "ipu") if torch.amp.is_autocast_available(d)
)


def follow_autocast(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, contextlib.AbstractContextManager]:
    """q, k, v as SDPA receives them under ``torch.autocast``, and the context to run the attention in.

    Inside an autocast region enabled for the tensors' device type, every float16/bfloat16/float32 input is cast
    to the autocast dtype (float64 stays float64, as autocast leaves it), and the attention itself runs with
    autocast off for that device, as one op, so a backend's float32 arithmetic is not lowered tile by tile.
    Outside autocast the tensors come back unchanged and mixed dtypes reach validation, which rejects them.
    Non-tensors pass through for validation to reject.
    """
    if not isinstance(q, torch.Tensor):
        return q, k, v, contextlib.nullcontext()
    device_type = q.device.type
    if device_type not in _AUTOCAST_DEVICES or not torch.is_autocast_enabled(device_type):
        return q, k, v, contextlib.nullcontext()
    dtype = torch.get_autocast_dtype(device_type)

    def cast(t):
        eligible = isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
        return t.to(dtype) if eligible and t.device.type == device_type else t

    return cast(q), cast(k), cast(v), torch.autocast(device_type, enabled=False)


def validate(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    window: tuple[int, int] | None = None,
    scale: float | None = None,
) -> tuple[float, Band]:
    """Check the inputs of `attention`; returns the resolved scale and the band. Raises ValueError/TypeError."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}; cast them first")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got q {q.device}, k {k.device}, v {v.device}")
    if k.shape != v.shape:
        raise ValueError(
            f"k and v must have the same shape (batch, kv_heads, seq_k, head_dim), "
            f"got k {tuple(k.shape)} and v {tuple(v.shape)}"
        )
    B, Hq, Sq, D = q.shape
    if k.shape[0] != B:
        raise ValueError(f"batch size differs: q has {B}, k and v have {k.shape[0]}")
    if k.shape[3] != D:
        raise ValueError(f"head_dim differs: q has {D}, k and v have {k.shape[3]}")
    Hkv = k.shape[1]
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(
            f"the number of query heads ({Hq}) must be a positive multiple of the number of key/value "
            f"heads ({Hkv}) for GQA/MQA; valid kv head counts are the divisors of {Hq}"
        )
    _check_flag("causal", causal)
    if scale is None:
        scale = 1.0 / math.sqrt(D) if D > 0 else 1.0
    else:
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
            raise TypeError(f"scale must be a real number or None, got {type(scale).__name__}")
        scale = float(scale)
        if not math.isfinite(scale):
            raise ValueError(f"scale must be finite, got {scale}")
    Sk = k.shape[2]
    band = Band.from_args(Sq, Sk, causal=causal, window=flash_window(window, causal=causal, seqlen_k=Sk))
    return scale, band


def check_softcap(softcap: object) -> float:
    """The softcap as a float: 0 (off) or a finite positive cap. TypeError / ValueError naming the argument."""
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(
            f"softcap must be a real number (0.0 = off, e.g. 50.0 for Gemma 2), got {softcap!r} "
            f"({type(softcap).__name__})"
        )
    value = float(softcap)
    if not math.isfinite(value) or value < 0:
        raise ValueError(
            f"softcap must be 0.0 (off) or a finite positive cap (scores -> softcap * tanh(scores / softcap)), "
            f"got {softcap!r}; pass softcap=0.0 or a positive value such as 50.0"
        )
    return value


def _check_flag(name: str, value: object) -> None:
    if not isinstance(value, (bool, torch.SymBool)):
        raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__}); pass {name}=bool(...)")


def _check_block_mask(block_mask: object) -> None:
    if block_mask is not None and not isinstance(block_mask, BlockMask):
        hint = " (for a causal mask pass causal=True)" if isinstance(block_mask, str) and block_mask == "causal" else ""
        raise TypeError(
            f"block_mask must be a longctx.BlockMask or None, got {block_mask!r} ({type(block_mask).__name__}); "
            f"build one with longctx.block_mask(mask_mod, B, H, Sq, Sk){hint}"
        )


def _assume_constant_result(fn):
    # What `torch.compiler.assume_constant_result` does (torch/_dynamo/decorators.py), without importing
    # torch._dynamo when longctx is imported: that import alone doubles the time of `import longctx`.
    # tests/unit/test_torch_compile.py checks that torch.compile still traces attention in one graph.
    fn._dynamo_marked_constant = True
    return fn


@_assume_constant_result
def _select_name_for_compile(
    requested: str,
    device: torch.device,
    dtype: torch.dtype,
    q_shape: tuple[int, ...],
    k_shape: tuple[int, ...],
    lo: int | None,
    hi: int | None,
    needs_grad: bool,
    return_lse: bool,
    deterministic: bool,
    has_block_mask: bool,
    softcap: float = 0.0,
) -> str:
    # Run by torch.compile at trace time, outside the graph: the choice (and the environment switches it reads)
    # is fixed for the compiled graph, so a model calling longctx.attention compiles without a graph break.
    B, Hq, Sq, D = q_shape
    cap = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    inp = AttnInputs(
        device, dtype, B, Hq, k_shape[1], Sq, k_shape[2], D, Band(lo, hi), needs_grad, return_lse, deterministic,
        has_block_mask, capability=cap, softcap=softcap,
    )  # fmt: skip
    return select_backend(requested, inp).backend.name


def _resolve(q, k, v, causal, window, scale, backend, return_lse, deterministic, block_mask, softcap=0.0):
    scale, band = validate(q, k, v, causal=causal, window=window, scale=scale)
    band = band.within(q.shape[2], k.shape[2])  # a window as wide as the sequence runs as no window (cuDNN takes it)
    softcap = check_softcap(softcap)
    _check_flag("return_lse", return_lse)
    _check_flag("deterministic", deterministic)
    _check_block_mask(block_mask)
    if block_mask is not None:
        block_mask.check_compatible(q, k)
    if torch.compiler.is_compiling() and q.numel() > 0 and k.shape[2] > 0:
        needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        name = _select_name_for_compile(
            backend, q.device, q.dtype, tuple(int(x) for x in q.shape), tuple(int(x) for x in k.shape),
            band.lo, band.hi, needs_grad, return_lse, deterministic, block_mask is not None, softcap,
        )  # fmt: skip
        return scale, band, BackendChoice(get_backend(name), "auto (fixed at compile time)")
    inp = AttnInputs.from_tensors(
        q,
        k,
        band=band,
        return_lse=return_lse,
        deterministic=deterministic,
        block_mask=block_mask is not None,
        softcap=softcap,
    )
    if q.numel() == 0 or k.shape[2] == 0:
        # Empty batch, Sq = 0 or Sk = 0: the reference handles these exactly (rows with no key give 0, -inf).
        if backend != "auto":
            get_backend(backend)  # still reject unknown names
        return scale, band, BackendChoice(get_backend("math"), "empty input")
    return scale, band, select_backend(backend, inp)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    window: tuple[int, int] | None = None,
    scale: float | None = None,
    backend: str = "auto",
    return_lse: bool = False,
    deterministic: bool = False,
    block_mask=None,
    softcap: float = 0.0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact softmax attention, ``softmax(q k^T * scale + mask) v``, on the best available backend.

    Args:
        q: (B, Hq, Sq, D) queries.
        k: (B, Hkv, Sk, D) keys; Hq must be a multiple of Hkv (GQA; Hkv == 1 is MQA). Query head h reads
            kv head ``h // (Hq // Hkv)``. K/V are never repeated in memory.
        v: (B, Hkv, Sk, D) values.
        causal: mask aligned to the bottom-right corner as in FlashAttention: query i sees key j iff
            ``j <= i + Sk - Sq``. (PyTorch SDPA aligns top-left; they agree when Sq == Sk.)

                Sq=3, Sk=5:   k0 k1 k2 k3 k4
                          q0   x  x  x  .  .
                          q1   x  x  x  x  .
                          q2   x  x  x  x  x

        window: ``(left, right)``, FlashAttention's window_size; -1 is unbounded. Query i sees key j iff
            ``i + Sk - Sq - left <= j <= i + Sk - Sq + right``. As in flash-attn, with causal the right side is 0
            whatever was passed, and a side of Sk or more is unbounded (`longctx.masks.flash_window`).
        scale: multiplies the scores; default ``1 / sqrt(D)``.
        backend: "auto" or a name from ``longctx.backends()`` ("triton", "tiled", "math", "sdpa_cudnn",
            "sdpa_flash", "sdpa_efficient", "flex").
        return_lse: also return the log-sum-exp of the scaled scores, (B, Hq, Sq), natural log, float32
            (float64 for float64 inputs).
        deterministic: require a backward pass that gives bitwise identical gradients on every run.
        block_mask: a `longctx.BlockMask` for block-sparse attention (see `longctx.block_mask`).
        softcap: logit softcapping (Gemma 2): with softcap > 0 the scaled scores ``s = q k^T * scale`` become
            ``softcap * tanh(s / softcap)`` before the mask and the softmax (lse is that of the capped scores);
            0.0 (the default) is off. Served by triton, triton_sparse, tiled and math; SDPA and FlexAttention refuse.

    Inside ``torch.autocast`` on the tensors' device, q, k and v are first cast to the autocast dtype (float64
    excepted), as for SDPA, so float32 q/k after RoPE and a bfloat16 v are accepted there.

    Returns:
        out (B, Hq, Sq, D) in q's dtype (the autocast dtype inside autocast), or ``(out, lse)`` with
        ``return_lse``. A row that sees no key gives output 0 and lse -inf, with zero gradients.

    Raises:
        TypeError: non-tensor inputs, unsupported dtypes, mixed dtypes outside autocast, a causal, return_lse or
            deterministic that is not a bool, a block_mask that is not a `longctx.BlockMask`.
        ValueError: wrong ranks or mismatched shapes, Hq not a multiple of Hkv, mixed devices, window
            values below -1, a non-finite scale,
            a negative or non-finite softcap, an unknown backend, or a pinned backend that cannot run these inputs.
    """
    q, k, v, run_ctx = follow_autocast(q, k, v)
    scale, band, choice = _resolve(
        q, k, v, causal, window, scale, backend, return_lse, deterministic, block_mask, softcap
    )
    softcap = float(softcap)
    with run_ctx:
        out, lse = choice.backend.run(
            q,
            k,
            v,
            scale=scale,
            band=band,
            return_lse=return_lse,
            deterministic=deterministic,
            block_mask=block_mask,
            softcap=softcap,
        )
    return (out, lse) if return_lse else out


def explain(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    window: tuple[int, int] | None = None,
    scale: float | None = None,
    backend: str = "auto",
    return_lse: bool = False,
    deterministic: bool = False,
    block_mask=None,
    softcap: float = 0.0,
) -> BackendChoice:
    """Which backend `attention` would use for these arguments, and why each other one was rejected.

    Takes the same arguments as `attention`; runs nothing. ``print(longctx.explain(q, k, v, causal=True))``.
    """
    q, k, v, _ = follow_autocast(q, k, v)
    return _resolve(q, k, v, causal, window, scale, backend, return_lse, deterministic, block_mask, softcap)[2]


def unsupported_flash_args(
    fn: str,
    dropout_p: float,
    softcap: float,
    alibi_slopes: object,
    block_table: object = None,
) -> float:
    """Reject flash-attn arguments that longctx's kernels do not implement (ValueError naming the argument); returns
    the softcap, checked (`check_softcap`)."""
    if dropout_p != 0.0:
        raise ValueError(
            f"{fn}: dropout_p={dropout_p} is not supported (longctx's kernels have no attention dropout); "
            "pass dropout_p=0.0"
        )
    try:
        softcap = check_softcap(softcap)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{fn}: {exc}") from None
    if alibi_slopes is not None:
        raise ValueError(
            f"{fn}: alibi_slopes is not supported (got a {type(alibi_slopes).__name__}); pass alibi_slopes=None"
        )
    if block_table is not None:
        raise ValueError(
            f"{fn}: block_table (a paged KV cache) is not supported (got a {type(block_table).__name__}); "
            "pass block_table=None with contiguous packed k and v"
        )
    return softcap


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    backend: str = "auto",
):
    """Drop-in for flash-attn's ``flash_attn_func`` (v2.6+ signature): (batch, seq, heads, head_dim) layout.

    Args:
        q: (B, Sq, Hq, D); k, v: (B, Sk, Hkv, D). Transposed as views, never copied.
        dropout_p: must be 0.0 (attention dropout is not implemented).
        softmax_scale: default 1/sqrt(D).
        causal, window_size: as in flash-attn (bottom-right causal; -1 unbounded).
        softcap: logit softcapping (Gemma 2): with softcap > 0 the scaled scores s become
            ``softcap * tanh(s / softcap)`` before the mask and softmax; 0.0 is off (see `attention`).
        alibi_slopes: not supported; must be None.
        deterministic: deterministic backward.
        return_attn_probs: also return ``(softmax_lse, None)``: lse (B, Hq, Sq) float32 as flash-attn does;
            the probabilities themselves are never materialised, so the third item is None.

    Inside ``torch.autocast`` on q's device, q, k and v are cast to the autocast dtype first (as `attention`).

    Returns:
        out (B, Sq, Hq, D), contiguous, or ``(out, softmax_lse, None)`` with ``return_attn_probs``.

    Raises:
        ValueError: dropout_p != 0, a negative softcap or alibi_slopes given; the errors of `attention`.
        TypeError: a softcap that is not a real number; the errors of `attention`.
    """
    softcap = unsupported_flash_args("longctx.flash_attn_func", dropout_p, softcap, alibi_slopes)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if isinstance(t, torch.Tensor) and t.dim() != 4:
            raise ValueError(
                f"{name} must have 4 dimensions (batch, seq, heads, head_dim) in flash_attn_func, "
                f"got shape {tuple(t.shape)}"
            )
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    # (B, S, H, D) -> (B, H, S, D): views, no copies.
    res = attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        causal=causal,
        window=tuple(window_size),
        scale=softmax_scale,
        backend=backend,
        return_lse=return_attn_probs,
        deterministic=deterministic,
        softcap=softcap,
    )
    out, lse = res if return_attn_probs else (res, None)
    out = out.transpose(1, 2)  # (B, Sq, Hq, D); the Triton launchers write this layout directly
    if not out.is_contiguous():
        out = out.contiguous()  # backends that write (B, H, S, D) (reference, SDPA): one copy
    return (out, lse, None) if return_attn_probs else out


def flash_attn_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    backend: str = "auto",
):
    """flash-attn's ``flash_attn_kvpacked_func``: `flash_attn_func` with kv (B, Sk, 2, Hkv, D) packed.

    k and v are views of ``kv[:, :, 0]`` and ``kv[:, :, 1]`` (no copies); gradients flow to kv.
    """
    if not isinstance(kv, torch.Tensor) or kv.dim() != 5 or kv.shape[2] != 2:
        raise ValueError(
            f"kv must be a tensor of shape (batch, seqlen_k, 2, heads_k, head_dim), got "
            f"{tuple(kv.shape) if isinstance(kv, torch.Tensor) else type(kv).__name__}"
        )
    k, v = kv.unbind(2)  # (B, Sk, Hkv, D) views
    return flash_attn_func(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
        return_attn_probs, backend=backend,
    )  # fmt: skip


def flash_attn_qkvpacked_func(
    qkv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    backend: str = "auto",
):
    """flash-attn's ``flash_attn_qkvpacked_func``: `flash_attn_func` with qkv (B, S, 3, H, D) packed.

    q, k and v are views of ``qkv[:, :, i]`` (no copies); gradients flow to qkv.
    """
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 5 or qkv.shape[2] != 3:
        raise ValueError(
            f"qkv must be a tensor of shape (batch, seqlen, 3, heads, head_dim), got "
            f"{tuple(qkv.shape) if isinstance(qkv, torch.Tensor) else type(qkv).__name__}"
        )
    q, k, v = qkv.unbind(2)  # (B, S, H, D) views
    return flash_attn_func(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
        return_attn_probs, backend=backend,
    )  # fmt: skip
