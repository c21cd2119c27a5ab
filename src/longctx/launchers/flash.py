"""The `triton` backend: launchers, torch.library ops with autograd, and the dispatch entry.

Layers, bottom up (the kernels themselves are in `longctx.kernels`):

- `triton_forward(q, k, v, *, scale, band) -> (out, lse)` and
  `triton_backward(do, q, k, v, out, lse, *, scale, band, deterministic=False) -> (dq, dk, dv)`: the
  launchers of the contract in `longctx.ops` (lse natural log, float32). Context parallelism calls these.
- ``torch.ops.longctx.triton_attn_fwd`` / ``triton_attn_bwd``: the same, registered with `torch.library`
  (fake implementations included) so `torch.compile` traces a model through them without a graph break;
  autograd is registered on the forward op (the lse output is differentiable too: d lse / d s = P).
- `TritonBackend`: name "triton", family "flash" (``LONGCTX_FLASH_ATTN=0`` / ``NVTE_FLASH_ATTN=0`` switch it
  off), first in the auto order on CUDA.

Policies:

- float16 and bfloat16. float32 is refused on CUDA by default: the kernels would compute its products in
  tf32 (about 1e-3 relative error, far from float32 accuracy). Set ``LONGCTX_TRITON_TF32=1`` to accept that
  documented tf32 path. Under the Triton interpreter (``TRITON_INTERPRET=1``, CPU tensors) float32 is exact.
- The fast backward (Sq > 2048; Sq > 4096 for dense bands at head dims <= 64) accumulates dQ in float32
  inside the dK/dV kernel: at D=128 each tile by one TMA bulk reduction (``LONGCTX_TRITON_DQ_TMA=0`` falls
  back to scalar atomics), at smaller head dims by scalar atomics. The order of the additions varies, so it
  is not bitwise repeatable.
  Elsewhere (where it measured as fast), and always under ``deterministic=True`` or
  ``LONGCTX_DETERMINISTIC=1``, a separate dQ kernel runs instead, without atomics (each gradient element
  written once, in a fixed order).
- On Hopper (sm_90) the forward of fp16/bf16 inputs at head dim 128 (and 64 without a band) runs the
  warp-specialised Gluon kernel (`longctx.kernels.gluon.flash_fwd_ws`) where it measured faster (`_ws_config`);
  ``LONGCTX_TRITON_WS=0`` keeps the Triton forward everywhere. Its output and lse are the same contract, so the
  backward is unchanged.
- Tiles are autotuned per (head dim, band kind, length bucket, dtype) from the short lists in
  `longctx.tuning`; ``LONGCTX_TRITON_AUTOTUNE=0`` uses the first entry of each list instead.
"""

from __future__ import annotations

import functools
import os

import torch

from longctx.launchers.runtime import (
    _cdiv,
    _dot_precision,
    _gluon_desc,
    _gluon_rows_desc,
    _interpret,
    _patch_interpreter_for_numpy2,
    _set_tma_allocator,
    _shared_layout,
    _tma_ok,
    _ws_capable,
    warn_ws_fallback,
)
from longctx.masks import Band

__all__ = ["triton_forward", "triton_backward"]

_INT_LIMIT = 1 << 30  # bands wider than any sequence are clamped so they fit the kernels' int32 arithmetic


def _autotune_enabled() -> bool:
    return not _interpret() and os.environ.get("LONGCTX_TRITON_AUTOTUNE", "1").strip().lower() not in (
        "0",
        "false",
        "off",
        "no",
    )


def _tf32_allowed() -> bool:
    return os.environ.get("LONGCTX_TRITON_TF32", "0").strip().lower() in ("1", "true", "on", "yes")


def _seq_bucket(n: int) -> int:
    """Length bucket of the autotune key: one per power of two from <=1K to <=16K, then longer. (Coarser buckets
    let the first length tuned decide for the next: 2K's tile was reused at 4K, 8K's at 16K.)"""
    return 0 if n <= 1024 else min(5, (n - 1).bit_length() - 10)


def _band_args(band: Band) -> tuple[int, int, bool, bool]:
    lo = 0 if band.lo is None else max(-_INT_LIMIT, min(_INT_LIMIT, int(band.lo)))
    hi = 0 if band.hi is None else max(-_INT_LIMIT, min(_INT_LIMIT, int(band.hi)))
    return lo, hi, band.lo is not None, band.hi is not None


@functools.cache
def _kernel(kind: str, bd: int):
    """The jit kernel of ``kind``, wrapped in triton.autotune over its config list when autotuning is on."""
    import triton

    from longctx import flash_bwd, flash_fwd
    from longctx import tuning as configs

    if _interpret():
        _patch_interpreter_for_numpy2()
    fn = {
        "fwd": flash_fwd.attn_fwd_kernel,
        "dkdv": flash_bwd.bwd_dkdv_kernel,
        "dkdv_atomic": flash_bwd.bwd_dkdv_kernel,
        "dq": flash_bwd.bwd_dq_kernel,
    }[kind]
    if not _autotune_enabled():
        return fn
    # The key holds every argument that changes which configs fit or win: the kernel variants (TMA loads, the
    # hand-pipelined QK^T, the TMA-reduce dQ) included, or a config tuned for one variant would be reused for
    # another (a 128x128 forward tile chosen with pointer loads does not fit shared memory with PIPE_QK).
    # (PIPE_QK is part of the forward's configs: the autotuner chooses it with the tiles.)
    variants = {"fwd": ["USE_TMA", "TMA_HOST"], "dkdv": ["USE_TMA"], "dkdv_atomic": ["USE_TMA", "DQ_TMA"], "dq": []}
    key = ["HEAD_DIM", "HAS_LO", "HAS_HI", "SEQ_BUCKET", "GROUP", *variants[kind]]
    # The atomic-dQ kernel adds into DQA: every timed config run would add its dQ again, so the autotuner zeroes
    # DQA before each run and before the real one (without it the first call of each key returned a wrong dQ).
    reset = ["DQA"] if kind == "dkdv_atomic" else None
    cfgs = configs.configs(kind, bd, pipe_qk=_PIPE_QK_DEFAULT, pre_hook=_PRE_HOOKS.get(kind))
    return triton.autotune(cfgs, key=key, reset_to_zero=reset)(fn)


def _fwd_desc_block(nargs: dict) -> None:
    """Give the forward's host-built K/V descriptors the block shape of the config about to run."""
    for name in ("DESC_K", "DESC_V"):
        desc = nargs[name]
        if hasattr(desc, "block_shape"):  # a TensorDescriptor (TMA_HOST); a plain tensor otherwise
            desc.block_shape = [1, 1, nargs["BLOCK_N"], nargs["BLOCK_D"]]


# run before each launch with the config's meta-parameters (the autotuner calls them per timed config too)
_PRE_HOOKS = {"fwd": _fwd_desc_block}


# For tuning sessions (benchmarks/sweep_triton.py): kind -> (BLOCK_M, BLOCK_N, num_warps, num_stages) forced,
# and kind -> extra constexpr kwargs (e.g. {"fwd": {"WARP_SPEC": True}}). Empty in normal use.
FORCE_CONFIG: dict[str, tuple[int, int, int, int]] = {}
EXTRA_KWARGS: dict[str, dict] = {}


def _launch(kind: str, bd: int, grid_fn, args: list, kwargs: dict) -> None:
    """Run one kernel: autotuned (BLOCK_M/BLOCK_N/warps/stages from the config) or with a fixed config."""
    from longctx import tuning as configs

    kernel = _kernel(kind, bd)
    if kind in FORCE_CONFIG:
        kernel = getattr(kernel, "fn", kernel)  # bypass the autotuner
        entry = FORCE_CONFIG[kind]
    elif _interpret():
        entry = configs.INTERPRET
    elif not _autotune_enabled():
        entry = configs.table(kind)[bd][0]
    else:
        kernel[lambda meta: grid_fn(meta["BLOCK_M"], meta["BLOCK_N"])](
            *args, **{**kwargs, **EXTRA_KWARGS.get(kind, {})}
        )
        return
    bm, bn, w, s = entry[:4]
    kwargs = {**kwargs, **configs.meta(kind, entry, _PIPE_QK_DEFAULT), **EXTRA_KWARGS.get(kind, {})}
    if kind in _PRE_HOOKS:
        _PRE_HOOKS[kind]({**dict(zip(kernel.arg_names, args)), **kwargs, "BLOCK_M": bm, "BLOCK_N": bn})
    kernel[grid_fn(bm, bn)](*args, **kwargs, BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s)


def _deterministic_env() -> bool:
    return os.environ.get("LONGCTX_DETERMINISTIC", "0").strip().lower() in ("1", "true", "on", "yes")


_USE_TMA_DEFAULT = os.environ.get("LONGCTX_TRITON_TMA", "1") != "0"
# The hand-pipelined QK^T (PIPE_QK): a per-config choice of the forward (configs.FWD; D=128 only, it lost at
# D=64); LONGCTX_TRITON_PIPE_QK=0 removes it from every config.
_PIPE_QK_DEFAULT = os.environ.get("LONGCTX_TRITON_PIPE_QK", "1") != "0"
# TMA for the backward's q/dO tiles measured slower than pointer loads (NOTES.md, run 3): off by default.
_TMA_BWD_DEFAULT = os.environ.get("LONGCTX_TRITON_TMA_BWD", "0") != "0"
# dQ tiles added by one TMA reduce each instead of scalar float32 atomics (NOTES.md, run 7).
_DQ_TMA_DEFAULT = os.environ.get("LONGCTX_TRITON_DQ_TMA", "1") != "0"
# The forward's K/V descriptors built once on the host (4-D, over (B, Hkv, Sk, D)) and passed by value, instead
# of by every program in the kernel (a global write and a fence per program): +0-6% (NOTES.md, session 4).
# LONGCTX_TRITON_TMA_HOST=0 builds them in the kernel.
_TMA_HOST_DEFAULT = os.environ.get("LONGCTX_TRITON_TMA_HOST", "1") != "0"
# For tuning sessions: force the atomic-dQ (True) or the separate-dQ (False) backward; None follows the rules.
FORCE_ATOMIC: bool | None = None

# The warp-specialised forward (`kernels.flash_fwd_ws`, Gluon; Hopper only): a producer warp feeding two consumer
# warpgroups through mbarriers. LONGCTX_TRITON_WS=0 keeps the Triton forward everywhere.
_WS_DEFAULT = os.environ.get("LONGCTX_TRITON_WS", "1") != "0"
# head dim -> (BLOCK_N, STAGES, PIPE): key tile, shared-memory ring depth, intra-warpgroup overlap. Sweep of
# session 5 (NOTES.md): 3 stages win for dense bands and long causal ones; 2 stages (the SHORT_CAUSAL entry) for
# causal-like bands up to 4K (460-469 vs 382-408 TFLOP/s at D=128 4K).
WS_CONFIG: dict[int, tuple[int, int, bool]] = {64: (128, 3, True), 128: (128, 3, True)}
WS_CONFIG_SHORT_CAUSAL: dict[int, tuple[int, int, bool]] = {128: (128, 2, True)}
# For tuning sessions: None follows the rules, True / False forces the warp-specialised forward on / off.
FORCE_WS: bool | None = None


def _ws_config(D: int, Sq: int, Sk: int, has_lo: bool, has_hi: bool) -> tuple[int, int, bool] | None:
    """The warp-specialised forward's config for these inputs, or None where the Triton forward measured faster
    (session 5 sweep, H100): D=64 with a band (causal 354 / 389 / 400 vs 331 / 381 / 413 TFLOP/s at 4K / 8K /
    16K), and D=128 causal-like bands up to 2K (353 vs 310 at 2K)."""
    if FORCE_WS:
        return WS_CONFIG.get(D)
    banded = has_lo or has_hi
    if D == 64 and banded:
        return None
    if D == 128 and banded:
        n = max(Sq, Sk)
        if n <= 2048:
            return None
        if n <= 4096:
            return WS_CONFIG_SHORT_CAUSAL[D]
    return WS_CONFIG.get(D)


def _ws_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """The warp-specialised forward is switched on and takes these inputs (`_ws_inputs_ok`). (Whether it is the
    faster kernel for them: `_ws_config`.)"""
    if FORCE_WS is False or not (_WS_DEFAULT or FORCE_WS):
        return False
    return _ws_inputs_ok(q, k, v)


def _ws_inputs_ok(*tensors: torch.Tensor) -> bool:
    """Inputs the warp-specialised kernels can take: fp16/bf16 on a Hopper GPU, head dim 64 or 128, TMA-loadable
    (unit stride on D, 16-byte aligned rows), no broadcast (stride 0) dims, sequences of at least 16."""
    q = tensors[0]
    if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    D = q.shape[3]
    if D not in WS_CONFIG or min(t.shape[2] for t in tensors) < 16:
        return False
    if not all(_tma_ok(t, D, D) and all(t.stride(i) > 0 for i in range(3)) for t in tensors):
        return False
    return _ws_capable(q.device.index if q.device.index is not None else torch.cuda.current_device())


def _disable_ws(exc: Exception, backward: bool = False) -> None:
    """A warp-specialised kernel did not compile with this Triton: warn once, use the Triton kernel from now."""
    global _WS_DEFAULT, _WS_BWD_DEFAULT

    if backward:
        _WS_BWD_DEFAULT = False
    else:
        _WS_DEFAULT = False
    warn_ws_fallback("backward" if backward else "forward", exc)


def _forward_ws(q, k, v, out, lse, scale, lo_i, hi_i, has_lo, has_hi, config) -> None:
    """Launch `flash_fwd_ws.attn_fwd_ws_kernel` (conditions: `_ws_ok`; config from `_ws_config`)."""
    from longctx.kernels.gluon import flash_fwd_ws

    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    block_n, stages, pipe = config

    rows = flash_fwd_ws.WG_ROWS * flash_fwd_ws.NUM_CONSUMERS
    longest_first = has_hi and not has_lo
    grid = (B * Hq, _cdiv(Sq, rows)) if longest_first else (_cdiv(Sq, rows), B * Hq)
    flash_fwd_ws.attn_fwd_ws_kernel[grid](
        _gluon_desc(q, int(flash_fwd_ws.WG_ROWS)), _gluon_desc(k, block_n), _gluon_desc(v, block_n), out, lse,
        *out.stride(),
        Hq, Sq, Sk, Hq // Hkv, lo_i, hi_i, float(scale) * 1.4426950408889634,
        HEAD_DIM=D, BLOCK_D=D, HAS_LO=has_lo, HAS_HI=has_hi, LONGEST_FIRST=longest_first,
        BLOCK_N=block_n, STAGES=stages, PIPE=pipe, CONSUMER_REGS=240, PRODUCER_REGS=24,
        num_warps=4, maxnreg=168,
    )  # fmt: skip


# The warp-specialised backward (`kernels.flash_bwd_ws`, Gluon; Hopper only): a producer warp streams Q, dO, lse2
# and Delta to two consumer warpgroups that each own 64 keys; dQ is added by the copy engine's bulk reduction (in
# no fixed order, so `deterministic=True` keeps the Triton kernels). LONGCTX_TRITON_WS_BWD=0 keeps the Triton
# backward everywhere.
_WS_BWD_DEFAULT = os.environ.get("LONGCTX_TRITON_WS_BWD", "1") != "0"
# head dim -> (BLOCK_M, STAGES, EARLY_DV): query tile, ring depth, dV's product issued before dS^T is computed
# (EARLY_DV: the same speed within noise, and dS from the bf16 P; 3 stages: no gain; session 6 sweeps). No other
# rule: in the session-6 sweep (H100, bf16, one call beside the Triton backward and FA2) it was faster at every case
# measured, D in {64, 128}, S = 2K-16K, dense and causal, GQA 4K-16K (D=128: 297-435 TFLOP/s against 247-396 for
# the Triton backward; D=64: 282-392 against 227-316).
WS_BWD_CONFIG: dict[int, tuple[int, int, bool]] = {64: (64, 2, False), 128: (64, 2, False)}
# For tuning sessions: None follows the rules, True / False forces the warp-specialised backward on / off.
FORCE_WS_BWD: bool | None = None


# How the warp-specialised backward adds dQ: True, the copy engine's bulk reduction from shared memory (TMA); False,
# float32 atomics from registers (10-23% slower on an H100: NOTES.md, session 8). For tuning sessions.
WS_BWD_DQ_TMA = True


def _dqa_desc(dqa: torch.Tensor, block_m: int, D: int):
    """TMA descriptor of the float32 (B, H, Sq, D) dQ accumulator for the bulk reduction: one consumer warpgroup's
    share of a query tile, (1, 1, block_m, D / 2) (or (1, 1, 64, D) with 128-row tiles: split by rows)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    block = [1, 1, 64, D] if block_m == 128 else [1, 1, block_m, D // 2]
    return TensorDescriptor(dqa, list(dqa.shape), list(dqa.stride()), block, _shared_layout(tuple(block), dqa.dtype))


def _backward_ws(q, k, v, do, delta, lse2, dk, dv, dqa, scale, lo_i, hi_i, has_lo, has_hi, config) -> None:
    """Launch `flash_bwd_ws.attn_bwd_ws_kernel`: dK, dV into ``dk`` / ``dv``, scale * dS K added into ``dqa``
    (float32, zeroed, contiguous). Conditions: `_ws_inputs_ok` for q, k, v and dO; config from `WS_BWD_CONFIG`."""
    from longctx.kernels.gluon import flash_bwd_ws

    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    block_m, stages, early_dv = config

    block_n = int(flash_bwd_ws.WG_ROWS) * int(flash_bwd_ws.NUM_CONSUMERS)
    flash_bwd_ws.attn_bwd_ws_kernel[(_cdiv(Sk, block_n), B * Hkv)](
        _gluon_desc(q, block_m), _gluon_desc(k, block_n), _gluon_desc(v, block_n), _gluon_desc(do, block_m),
        _gluon_rows_desc(lse2, block_m), _gluon_rows_desc(delta, block_m),
        dk, dv, dqa, _dqa_desc(dqa, block_m, D) if WS_BWD_DQ_TMA else dqa,
        *dk.stride(), *dv.stride(), *dqa.stride()[:3],
        Hq, Hkv, Sq, Sk, Hq // Hkv, lo_i, hi_i, lse2.shape[2], float(scale) * 1.4426950408889634, float(scale),
        BLOCK_D=D, HAS_LO=has_lo, HAS_HI=has_hi, BLOCK_M=block_m, STAGES=stages, EARLY_DV=early_dv,
        CONSUMER_REGS=240, PRODUCER_REGS=24, DQ_TMA=WS_BWD_DQ_TMA, num_warps=4, maxnreg=168,
    )  # fmt: skip


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"expected q (B, Hq, Sq, D), k and v (B, Hkv, Sk, D); got {q.shape}, {k.shape}, {v.shape}")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"Hq ({q.shape[1]}) must be a multiple of Hkv ({k.shape[1]})")
    if q.shape[3] > 256:
        raise ValueError(f"the triton backend supports head dims up to 256, got {q.shape[3]}")


def _forward_impl(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, lo: int | None, hi: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    _check(q, k, v)
    B, Hq, Sq, D = q.shape  # q (B, Hq, Sq, D)
    Hkv, Sk = k.shape[1], k.shape[2]  # k, v (B, Hkv, Sk, D)
    out = torch.empty_like(q)  # same memory layout as q: (B, S, H, D) inputs give (B, S, H, D) outputs
    lse = torch.empty((B, Hq, Sq), device=q.device, dtype=torch.float32)
    if out.numel() == 0:
        return out, lse
    if Sk == 0:
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    from longctx import tuning as configs

    bd = configs.block_d(D)
    lo_i, hi_i, has_lo, has_hi = _band_args(Band(lo, hi))
    ws_config = _ws_config(D, Sq, Sk, has_lo, has_hi) if _ws_ok(q, k, v) else None
    if ws_config is not None:
        try:
            _forward_ws(q, k, v, out, lse, scale, lo_i, hi_i, has_lo, has_hi, ws_config)
            return out, lse
        except Exception as exc:  # Gluon is experimental: a Triton whose Gluon changed fails at compile time
            if type(exc).__name__ != "CompilationError":
                raise
            _disable_ws(exc)
    longest_first = has_hi and not has_lo
    # Sq or Sk == 1 is specialised by Triton; ptxas crashed (SIGSEGV) on that TMA variant at D=256 (GPU
    # test run 4), and TMA gains nothing on such tiny inputs: pointer loads there.
    # (Short causal inputs used to take pointer loads too, when each program built its own descriptors: that fixed
    # cost lost to pointer loads at 2K. With the descriptors built once on the host, TMA wins there as well:
    # D=128 2K causal 365 vs 345 TFLOP/s, D=64 308 vs 290; NOTES.md, session 4.)
    use_tma = _USE_TMA_DEFAULT and min(Sq, Sk) >= 16 and _tma_ok(k, D, bd) and _tma_ok(v, D, bd)
    use_tma = use_tma and (_TMA_HOST_DEFAULT or not (longest_first and max(Sq, Sk) <= 2048 and bd >= 128))
    forced = EXTRA_KWARGS.get("fwd", {})  # tuning sessions may force the variant
    use_tma = forced.get("USE_TMA", use_tma)
    # the host descriptor spans (B, Hkv, Sk, D) with k's own strides: not for broadcast (stride 0) views, e.g.
    # K/V expanded over heads; those keep the per-program descriptors, which use the row stride only
    tma_host = (
        use_tma and forced.get("TMA_HOST", _TMA_HOST_DEFAULT) and all(t.stride(i) > 0 for t in (k, v) for i in range(3))
    )
    desc_k, desc_v = k, v  # unused by the kernel unless TMA_HOST
    if tma_host:
        from triton.tools.tensor_descriptor import TensorDescriptor

        # the block shape is set per config before each launch (`_fwd_desc_block`)
        desc_k, desc_v = (TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, 16, bd]) for t in (k, v))
    elif use_tma:
        _set_tma_allocator()
    _launch(
        "fwd",
        bd,
        (lambda bm, bn: (B * Hq, _cdiv(Sq, bm))) if longest_first else (lambda bm, bn: (_cdiv(Sq, bm), B * Hq)),
        [q, k, v, out, lse, desc_k, desc_v, *q.stride(), *k.stride(), *v.stride(), *out.stride()],
        dict(
            Hq=Hq,
            Sq=Sq,
            Sk=Sk,
            GROUP=Hq // Hkv,
            lo=lo_i,
            hi=hi_i,
            qk_scale=float(scale) * 1.4426950408889634,
            SEQ_BUCKET=_seq_bucket(max(Sq, Sk)),
            HEAD_DIM=D,
            BLOCK_D=bd,
            HAS_LO=has_lo,
            HAS_HI=has_hi,
            LONGEST_FIRST=longest_first,
            DOT_PRECISION=_dot_precision(q.dtype),
            USE_TMA=use_tma,
            TMA_HOST=tma_host,
        ),
    )
    return out, lse


def bwd_preprocess(
    out: torch.Tensor,
    do: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    block_d: int,
    row_stride: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward's first pass, shared with the block-sparse kernels: ``(delta, lse2)``, each (B, Hq, Sq), or
    (B, Hq, row_stride) zero-padded past Sq when ``row_stride`` is given.

    delta = rowsum(dO * O) - dlse; lse2 = lse in base 2, +inf on rows that see no key (so P recomputes as 0).
    """
    from longctx.kernels.triton import flash_bwd

    B, Hq, Sq, D = out.shape
    lse = lse.float().contiguous()  # (B, Hq, Sq)
    if dlse is not None:
        dlse = dlse.float().contiguous()  # (B, Hq, Sq)
    stride = Sq if row_stride is None else row_stride
    alloc = torch.empty if stride == Sq else torch.zeros  # padding read by the WS backward must be finite
    delta = alloc((B, Hq, stride), device=lse.device, dtype=torch.float32)
    lse2 = alloc((B, Hq, stride), device=lse.device, dtype=torch.float32)
    pre_bm = 16 if _interpret() else 64
    flash_bwd.bwd_preprocess_kernel[(_cdiv(Sq, pre_bm), B * Hq)](
        out,
        do,
        lse,
        lse if dlse is None else dlse,
        delta,
        lse2,
        *out.stride(),
        *do.stride(),
        Hq,
        Sq,
        stride,
        HEAD_DIM=D,
        BLOCK_D=block_d,
        BLOCK_M=pre_bm,
        HAS_DLSE=dlse is not None,
        num_warps=4,
    )
    return delta, lse2


def _backward_impl(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    scale: float,
    lo: int | None,
    hi: int | None,
    deterministic: bool = False,
    grad_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check(q, k, v)
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    # The kernels store through the pointers' dtype: float32 gradients come at no extra pass.
    dq = torch.empty_like(q, dtype=grad_dtype or q.dtype)
    dk = torch.empty_like(k, dtype=grad_dtype or k.dtype)
    dv = torch.empty_like(v, dtype=grad_dtype or v.dtype)
    if dq.numel() == 0 or dk.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    from longctx import tuning as configs

    bd = configs.block_d(D)
    lo_i, hi_i, has_lo, has_hi = _band_args(Band(lo, hi))
    _kernel("dq", bd)  # applies the interpreter shim if needed
    ws_config = None
    if (
        not (deterministic or _deterministic_env())
        and (_WS_BWD_DEFAULT or FORCE_WS_BWD)
        and FORCE_WS_BWD is not False
        and B * Hkv <= 65535  # the second grid dimension
        and _ws_inputs_ok(q, k, v, do)
    ):
        ws_config = WS_BWD_CONFIG.get(D)
    # the WS kernel loads each head's lse2 / Delta rows by TMA: 16-byte aligned rows, so padded to 4 floats
    delta, lse2 = bwd_preprocess(out, do, lse, dlse, bd, _cdiv(Sq, 4) * 4 if ws_config is not None else None)
    common = dict(
        Sq=Sq,
        Sk=Sk,
        GROUP=Hq // Hkv,
        lo=lo_i,
        hi=hi_i,
        qk_scale=float(scale) * 1.4426950408889634,
        sm_scale=float(scale),
        SEQ_BUCKET=_seq_bucket(max(Sq, Sk)),
        HEAD_DIM=D,
        BLOCK_D=bd,
        HAS_LO=has_lo,
        HAS_HI=has_hi,
        DOT_PRECISION=_dot_precision(q.dtype),
    )
    # Fast path: dQ accumulated with float32 atomics inside the dK/dV kernel (5 matmuls per tile pair).
    # Deterministic path: a separate dQ kernel recomputes P and dP (7 matmuls), each element written once.
    # At head dims above 128 the atomic variant does not fit shared memory (263 KB needed), so never there.
    # Which path is faster was measured (NOTES.md, v4 and v5). D=128: with dQ added by TMA reduce the atomic
    # path wins from Sq = 4K for dense and causal bands alike (8K: 370 vs 293 TFLOP/s full, 332 vs 294
    # causal); at 2K the separate kernels win (260 vs 232). D <= 64 (scalar atomics; the TMA reduce loses
    # there): separate kernels up to 2K; causal-like bands take the atomics from 4K (275 vs 245), dense
    # bands only from 8K (309 / 315 vs 290 / 294 at 8K / 16K; at 4K 271 separate vs 260).
    # GQA at D=128 (session 3): the separate kernels with 128x128 dQ tiles beat the atomics (8K causal 322 vs
    # 302, 16K 339 vs 319), so grouped heads take the separate path there.
    atomic = (
        not (deterministic or _deterministic_env())
        and bd <= 128
        and Sq > (4096 if bd <= 64 and Band(lo, hi).is_dense else 2048)
        and not (bd == 128 and Hq != Hkv)
    )
    if FORCE_ATOMIC is not None and not (deterministic or _deterministic_env()):
        atomic = FORCE_ATOMIC
    if ws_config is not None:
        dqa = torch.zeros((B, Hq, Sq, D), device=q.device, dtype=torch.float32)
        try:
            _backward_ws(q, k, v, do, delta, lse2, dk, dv, dqa, scale, lo_i, hi_i, has_lo, has_hi, ws_config)
        except Exception as exc:  # a Triton whose Gluon does not take the kernel: warn once, use the Triton kernels
            if type(exc).__name__ != "CompilationError":
                raise
            _disable_ws(exc, backward=True)
            delta, lse2 = bwd_preprocess(out, do, lse, dlse, bd)  # unpadded rows for the Triton kernels
        else:
            dq.copy_(dqa)  # the kernel already applied the scale
            return dq, dk, dv
    use_tma = _TMA_BWD_DEFAULT and _tma_ok(q, D, bd) and _tma_ok(do, D, bd)
    # the float32 accumulator is ours (contiguous): TMA needs only a CUDA tensor and D == BLOCK_D (rows of
    # 4*D bytes, a multiple of 16); it measured faster than scalar atomics at D=128 only
    dq_tma = atomic and _DQ_TMA_DEFAULT and D == 128 and not _interpret() and q.is_cuda
    if use_tma or dq_tma:
        _set_tma_allocator()
    dqa = torch.zeros((B, Hq, Sq, D), device=q.device, dtype=torch.float32) if atomic else dq  # (B, Hq, Sq, D)
    _launch(
        "dkdv_atomic" if atomic else "dkdv",
        bd,
        lambda bm, bn: (B * Hkv, _cdiv(Sk, bn)),
        [q, k, v, do, lse2, delta, dk, dv, dqa, *q.stride(), *k.stride(), *v.stride(), *do.stride()]
        + [*dk.stride(), *dv.stride(), *dqa.stride()[:3]],
        dict(Hq=Hq, Hkv=Hkv, ATOMIC_DQ=atomic, USE_TMA=use_tma, DQ_TMA=dq_tma, **common),
    )
    if atomic:
        dq.copy_(dqa)  # the kernel already applied the scale
        return dq, dk, dv
    _launch(
        "dq",
        bd,
        lambda bm, bn: (B * Hq, _cdiv(Sq, bm)),
        [q, k, v, do, lse2, delta, dq, *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dq.stride()],
        dict(Hq=Hq, LONGEST_FIRST=has_hi and not has_lo, **common),
    )
    return dq, dk, dv


# -- the launchers of the contract (longctx.ops) --


def triton_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, band: Band
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention forward with the Triton kernel; no autograd.

    Args:
        q: (B, Hq, Sq, D); k, v: (B, Hkv, Sk, D), any strides (the (B, S, H, D) layout needs no copy).
        scale: multiplies q . k.
        band: `Band` (lo <= j - i <= hi), any integer bounds, e.g. ``band.shifted(delta)`` from a ring step.

    Returns:
        out (B, Hq, Sq, D) in q's dtype and memory layout; lse (B, Hq, Sq) float32, natural log, -inf on
        rows that see no key (their output is 0).
    """
    return _forward_impl(q, k, v, float(scale), band.lo, band.hi)


def triton_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    scale: float,
    band: Band,
    deterministic: bool = False,
    dlse: torch.Tensor | None = None,
    grad_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention backward with the Triton kernels: ``(dq, dk, dv)`` in the input dtypes and layouts.

    ``lse`` is the forward's (natural log). ``dlse`` (B, Hq, Sq), optional, is a gradient flowing into the
    lse itself. By default dQ is accumulated with float32 atomics (fast, not bitwise repeatable);
    ``deterministic=True`` or ``LONGCTX_DETERMINISTIC=1`` use a separate dQ kernel instead, without atomics.
    ``grad_dtype`` (e.g. float32) writes the gradients in that dtype instead of the inputs': context
    parallelism sums per-block gradients and must not round each one to bf16 first.
    """
    return _backward_impl(do, q, k, v, out, lse, dlse, float(scale), band.lo, band.hi, deterministic, grad_dtype)
