"""The dense launchers: the Triton kernels on any CUDA GPU, the warp-specialised Gluon kernels on Hopper.

- `triton_forward(q, k, v, *, scale, band) -> (out, lse)` and
  `triton_backward(do, q, k, v, out, lse, *, scale, band, deterministic=False) -> (dq, dk, dv)`: the launchers of
  the contract in `longctx.launchers` (lse natural log, float32). Context parallelism calls these; the autograd op
  is `longctx.ops.flash`.
- `_forward_impl` / `_backward_impl`: the same with the band as two optional integers (the op's arguments).

Which kernel, tile and variant runs is decided by `longctx.tuning` (its measured rules, and the developer overrides
read there); this module only applies them:

- forward: the warp-specialised kernel (`kernels.gluon.flash_fwd_ws`) for fp16/bf16 on Hopper where
  `tuning.ws_fwd_config` says it is faster, else the Triton kernel with K/V through TMA descriptors where the
  tensors allow it (`tuning.fwd_kv_loads`).
- backward: the warp-specialised kernel (dQ by the copy engine's bulk reduction) for fp16/bf16 on Hopper at D 64
  and 128 (`tuning.ws_bwd_config`); at D=256 the warp-specialised dK/dV kernel (`kernels.gluon.flash_bwd_ws_d256`)
  and the Triton dQ kernel. Else the Triton dK/dV kernel with dQ added by atomics where `tuning.atomic_dq` says it
  is faster, else a separate dQ kernel; at D=256 the dK/dV kernel runs twice, for dV and for dK
  (`tuning.split_dkdv`).
  Atomics add in no fixed order: ``deterministic=True`` always takes the Triton kernels with the separate dQ kernel,
  each gradient element written once (bitwise repeatable). The user switch ``LONGCTX_DETERMINISTIC=1`` is read by
  the backends (`longctx.switches`) and arrives here as ``deterministic``.
- float32 inputs compute their products in tf32 on the GPU (exact under the interpreter); the `triton` backend
  refuses them unless ``LONGCTX_TRITON_TF32=1``.
- logit softcapping (``softcap > 0``, scores -> ``softcap * tanh(scores / softcap)``): the same kernels as without it
  (warp-specialised or Triton, chosen by the same rules), compiled with SOFTCAP set, forward and backward
  (`_score_scales` gives the kernels' two score factors).
"""

from __future__ import annotations

import functools

import torch

from longctx import tuning
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
    device_index,
    gpu_name,
    launch,
    out_like,
    warn_ws_fallback,
)
from longctx.masks import Band

__all__ = ["triton_forward", "triton_backward"]

_INT_LIMIT = 1 << 30  # bands wider than any sequence are clamped so they fit the kernels' int32 arithmetic
_LOG2E = 1.4426950408889634


def _autotune_enabled() -> bool:
    """Run-time autotuning over `tuning`'s tile lists: only with the ``autotune`` override on (kernel development);
    the launches otherwise take the entry `tuning.MEASURED_TILES` names for this GPU, so a new length never stalls
    on compiling and timing candidates. Never under the interpreter."""
    return not _interpret() and tuning.get("autotune") is True


def _score_scales(scale: float, softcap: float) -> tuple[float, float]:
    """The kernels' score factors ``(qk_scale, softcap_scale)``: without softcap the scores in base 2 are
    ``q.k * qk_scale`` with qk_scale = scale * log2(e) (softcap_scale unused); with softcap the kernels first replace
    q.k by ``tanh(q.k * softcap_scale)``, softcap_scale = scale / softcap, and qk_scale = softcap * log2(e), so the
    base-2 scores are ``softcap * tanh(scale * q.k / softcap) * log2(e)``: the cap in natural units, then log2(e)."""
    if softcap == 0:
        return float(scale) * _LOG2E, 0.0
    return float(softcap) * _LOG2E, float(scale) / float(softcap)


def _band_args(band: Band) -> tuple[int, int, bool, bool]:
    lo = 0 if band.lo is None else max(-_INT_LIMIT, min(_INT_LIMIT, int(band.lo)))
    hi = 0 if band.hi is None else max(-_INT_LIMIT, min(_INT_LIMIT, int(band.hi)))
    return lo, hi, band.lo is not None, band.hi is not None


@functools.cache
def _kernel(kind: str, bd: int, autotune: bool):
    """The jit kernel of ``kind``, wrapped in triton.autotune over its tile list when ``autotune``."""
    import triton

    from longctx.kernels.triton import flash_bwd, flash_fwd

    if _interpret():
        _patch_interpreter_for_numpy2()
    fn = {
        "fwd": flash_fwd.attn_fwd_kernel,
        "dkdv": flash_bwd.bwd_dkdv_kernel,
        "dkdv_atomic": flash_bwd.bwd_dkdv_kernel,
        "dk": flash_bwd.bwd_dkdv_kernel,
        "dv": flash_bwd.bwd_dkdv_kernel,
        "dq": flash_bwd.bwd_dq_kernel,
    }[kind]
    if not autotune:
        return fn
    # The key holds every argument that changes which configs fit or win, the kernel variants included (a 128x128
    # forward tile chosen with pointer loads does not fit shared memory with PIPE_QK and TMA); PIPE_QK itself is
    # part of the forward's configs, chosen with the tiles.
    variants = {"fwd": ["USE_TMA", "TMA_HOST"], "dkdv": [], "dkdv_atomic": ["DQ_TMA"], "dk": [], "dv": [], "dq": []}
    key = ["HEAD_DIM", "HAS_LO", "HAS_HI", "SEQ_BUCKET", "GROUP", *variants[kind]]
    # The atomic-dQ kernel adds into DQA: every timed config run would add its dQ again, so the autotuner zeroes
    # DQA before each run and before the real one.
    reset = ["DQA"] if kind == "dkdv_atomic" else None
    hook = _PRE_HOOKS.get(kind)
    cfgs = [triton.Config(kw, num_warps=w, num_stages=s, pre_hook=hook) for kw, w, s in tuning.entries(kind, bd)]
    return triton.autotune(cfgs, key=key, reset_to_zero=reset)(fn)


def _fwd_desc_block(nargs: dict) -> None:
    """Give the forward's host-built K/V descriptors the block shape of the config about to run."""
    for name in ("DESC_K", "DESC_V"):
        desc = nargs[name]
        if hasattr(desc, "block_shape"):  # a TensorDescriptor (TMA_HOST); a plain tensor otherwise
            desc.block_shape = [1, 1, nargs["BLOCK_N"], nargs["BLOCK_D"]]


# run before each launch with the config's meta-parameters (the autotuner calls them per timed config too)
_PRE_HOOKS = {"fwd": _fwd_desc_block}


def _launch(kind: str, bd: int, grid_fn, args: list, kwargs: dict) -> None:
    """Run one kernel with the tile entry measured for this GPU and case (`tuning.measured_index`), a forced one
    (the ``tiles`` override), the interpreter's, or autotuned at run time (the ``autotune`` override on)."""
    forced = tuning.tiles(tuning.get("tiles")).get(kind)
    autotune = forced is None and _autotune_enabled()
    kernel = _kernel(kind, bd, autotune)
    if autotune:
        kernel[lambda meta: grid_fn(meta["BLOCK_M"], meta["BLOCK_N"])](*args, **kwargs)
        return
    entry = forced or (tuning.INTERPRET if _interpret() else _measured_entry(kind, bd, args[0], kwargs))
    bm, bn, w, s = entry[:4]
    kwargs = {**kwargs, **tuning.meta(kind, entry)}
    if kind in _PRE_HOOKS:
        _PRE_HOOKS[kind]({**dict(zip(kernel.arg_names, args)), **kwargs, "BLOCK_M": bm, "BLOCK_N": bn})
    launch(kernel, grid_fn(bm, bn), *args, **kwargs, BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s)


def _measured_entry(kind: str, bd: int, q: torch.Tensor, kwargs: dict) -> tuple:
    """The tile entry `tuning.MEASURED_TILES` names for this GPU, kernel, band kind, length bucket and grouping."""
    entries = tuning.table(kind)[bd]
    band = tuning.band_kind(kwargs["HAS_LO"], kwargs["HAS_HI"])
    key = tuning.tile_key(kind, bd, band, kwargs["SEQ_BUCKET"], kwargs["GROUP"] > 1)
    return entries[tuning.measured_index(gpu_name(device_index(q)), key, len(entries))]


# The warp-specialised kernels that failed to compile with this Triton (`_disable_ws`): "fwd", "bwd".
_WS_BROKEN: set[str] = set()


def _ws_wanted(which: str) -> bool | None:
    """The ``ws`` / ``ws_bwd`` override: True forces the warp-specialised kernel, False keeps the Triton one, None
    lets the rules decide (unless the kernel failed to compile here)."""
    forced = tuning.get("ws" if which == "fwd" else "ws_bwd")
    if forced is None and which in _WS_BROKEN:
        return False
    return forced


def _ws_config(D: int, Sq: int, Sk: int, has_lo: bool, has_hi: bool) -> tuple[int, int, bool] | None:
    """The warp-specialised forward's config for these inputs: `tuning.ws_fwd_config` (everywhere with the ``ws``
    override on), the ``ws_config`` override in its place."""
    forced = tuning.ints(tuning.get("ws_config"))
    if _ws_wanted("fwd"):
        config = tuning.WS_CONFIG.get(D)
    else:
        config = tuning.ws_fwd_config(D, Sq, Sk, has_lo or has_hi)
    if config is not None and forced is not None:
        config = forced
    return None if config is None else (int(config[0]), int(config[1]), bool(config[2]))


def _ws_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """The warp-specialised forward is not switched off and takes these inputs (`_ws_inputs_ok`). (Whether it is
    the faster kernel for them: `_ws_config`.)"""
    return _ws_wanted("fwd") is not False and _ws_inputs_ok(q, k, v)


def _ws_inputs_ok(*tensors: torch.Tensor) -> bool:
    """Inputs the warp-specialised kernels can take: fp16/bf16 on a Hopper GPU, a head dim of `tuning.WS_CONFIG`
    (64, 128, 256; the backward has its own, `tuning.WS_BWD_CONFIG`), TMA-loadable (unit stride on D, 16-byte aligned
    rows), no broadcast (stride 0) dims, sequences of at least 16."""
    q = tensors[0]
    if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    D = q.shape[3]
    if D not in tuning.WS_CONFIG or min(t.shape[2] for t in tensors) < 16:
        return False
    if not all(_tma_ok(t, D, D) and all(t.stride(i) > 0 for i in range(3)) for t in tensors):
        return False
    return _ws_capable(q.device.index if q.device.index is not None else torch.cuda.current_device())


def _disable_ws(exc: Exception, backward: bool = False) -> None:
    """A warp-specialised kernel did not compile with this Triton: warn once, use the Triton kernel from now."""
    _WS_BROKEN.add("bwd" if backward else "fwd")
    warn_ws_fallback("backward" if backward else "forward", exc)


def _forward_ws(q, k, v, out, lse, scale, lo_i, hi_i, has_lo, has_hi, config, softcap=0.0) -> None:
    """Launch `flash_fwd_ws.attn_fwd_ws_kernel` (conditions: `_ws_ok`; config from `_ws_config`); ``softcap`` != 0
    compiles it with SOFTCAP."""
    from longctx.kernels.gluon import flash_fwd_ws

    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    block_n, stages, pipe = config

    rows = flash_fwd_ws.WG_ROWS * flash_fwd_ws.NUM_CONSUMERS
    longest_first = has_hi and not has_lo
    grid = (B * Hq, _cdiv(Sq, rows)) if longest_first else (_cdiv(Sq, rows), B * Hq)
    qk_scale, softcap_scale = _score_scales(scale, softcap)
    launch(
        flash_fwd_ws.attn_fwd_ws_kernel, grid,
        _gluon_desc(q, int(flash_fwd_ws.WG_ROWS)), _gluon_desc(k, block_n), _gluon_desc(v, block_n), out, lse,
        *out.stride(),
        Hq, Sq, Sk, Hq // Hkv, lo_i, hi_i, qk_scale, softcap_scale,
        HEAD_DIM=D, BLOCK_D=D, HAS_LO=has_lo, HAS_HI=has_hi, LONGEST_FIRST=longest_first,
        BLOCK_N=block_n, STAGES=stages, PIPE=pipe, CONSUMER_REGS=240, PRODUCER_REGS=24, SOFTCAP=softcap != 0,
        num_warps=4, maxnreg=168,
    )  # fmt: skip


def _ws_bwd_config(D: int) -> tuple[int, int, bool] | None:
    """The warp-specialised backward's config: `tuning.ws_bwd_config`, the ``ws_bwd_config`` override in its
    place."""
    config = tuning.ws_bwd_config(D)
    forced = tuning.ints(tuning.get("ws_bwd_config"))
    if config is not None and forced is not None:
        config = forced
    return None if config is None else (int(config[0]), int(config[1]), bool(config[2]))


def _dqa_desc(dqa: torch.Tensor, block_m: int, D: int):
    """TMA descriptor of the float32 (B, H, Sq, D) dQ accumulator for the bulk reduction: one consumer warpgroup's
    share of a query tile, (1, 1, block_m, D / 2) (or (1, 1, 64, D) with 128-row tiles: split by rows)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    block = [1, 1, 64, D] if block_m == 128 else [1, 1, block_m, D // 2]
    return TensorDescriptor(dqa, list(dqa.shape), list(dqa.stride()), block, _shared_layout(tuple(block), dqa.dtype))


def _backward_ws(q, k, v, do, delta, lse2, dk, dv, dqa, scale, lo_i, hi_i, has_lo, has_hi, config, softcap=0.0) -> None:
    """Launch `flash_bwd_ws.attn_bwd_ws_kernel`: dK, dV into ``dk`` / ``dv``, scale * dS K added into ``dqa``
    (float32, zeroed, contiguous). Conditions: `_ws_inputs_ok` for q, k, v and dO; config from `_ws_bwd_config`;
    ``softcap`` != 0 compiles it with SOFTCAP."""
    from longctx.kernels.gluon import flash_bwd_ws

    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    block_m, stages, early_dv = config

    block_n = int(flash_bwd_ws.WG_ROWS) * int(flash_bwd_ws.NUM_CONSUMERS)
    qk_scale, softcap_scale = _score_scales(scale, softcap)
    launch(
        flash_bwd_ws.attn_bwd_ws_kernel, (_cdiv(Sk, block_n), B * Hkv),
        _gluon_desc(q, block_m), _gluon_desc(k, block_n), _gluon_desc(v, block_n), _gluon_desc(do, block_m),
        _gluon_rows_desc(lse2, block_m), _gluon_rows_desc(delta, block_m),
        dk, dv, dqa, _dqa_desc(dqa, block_m, D),
        *dk.stride(), *dv.stride(), *dqa.stride()[:3],
        Hq, Hkv, Sq, Sk, Hq // Hkv, lo_i, hi_i, lse2.shape[2], qk_scale, float(scale), softcap_scale,
        BLOCK_D=D, HAS_LO=has_lo, HAS_HI=has_hi, BLOCK_M=block_m, STAGES=stages, EARLY_DV=early_dv,
        CONSUMER_REGS=240, PRODUCER_REGS=24, SOFTCAP=softcap != 0, num_warps=4, maxnreg=168,
    )  # fmt: skip


def _backward_ws_d256(q, k, v, do, delta, lse2, dk, dv, scale, lo_i, hi_i, has_lo, has_hi, config, softcap=0.0) -> None:
    """Launch `flash_bwd_ws_d256.attn_bwd_dkdv_ws_d256_kernel`: dK, dV into ``dk`` / ``dv`` (dQ is the Triton dQ
    kernel's). ``delta`` / ``lse2``: the preprocessing kernel's unpadded (B, Hq, Sq) rows. Config from
    `_ws_bwd_config` (its STAGES; the kernel's tiles are fixed)."""
    from longctx.kernels.gluon import flash_bwd_ws_d256 as wide

    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    rows, cta = int(wide.BLOCK_M), int(wide.BLOCK_N)
    qk_scale, softcap_scale = _score_scales(scale, softcap)
    launch(
        wide.attn_bwd_dkdv_ws_d256_kernel, (_cdiv(Sk, cta), B * Hkv),
        _gluon_desc(q, rows), _gluon_desc(k, cta), _gluon_desc(v, cta), _gluon_desc(do, rows), lse2, delta, dk, dv,
        *dk.stride(), *dv.stride(),
        Hq, Hkv, Sq, Sk, Hq // Hkv, lo_i, hi_i, qk_scale, float(scale), softcap_scale,
        BLOCK_D=D, HAS_LO=has_lo, HAS_HI=has_hi, STAGES=config[1],
        CONSUMER_REGS=240, PRODUCER_REGS=24, SOFTCAP=softcap != 0, num_warps=4, maxnreg=168,
    )  # fmt: skip


def _band_mask(kind: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lo, hi, *more: torch.Tensor):
    """The band as a `BlockMask` where this call ("fwd" or "bwd"; ``more``: the backward's dO) runs the block-sparse
    kernels instead (`tuning.band_via_sparse`, with their warp-specialised kernels able to take these inputs, outside
    CUDA graph capture; the ``band_sparse`` override forces it either way), else None. Dense and empty bands stay."""
    forced = tuning.get("band_sparse")
    if (lo is None and hi is None) or forced is False or q.numel() == 0 or k.shape[2] == 0:
        return None
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    first = -(Sq - 1) if lo is None else max(int(lo), -(Sq - 1))
    last = Sk - 1 if hi is None else min(int(hi), Sk - 1)
    if last < first:
        return None
    from longctx.launchers import sparse

    if not forced:
        blocks = _cdiv(Sq, 128) * _cdiv(Sk, 128)
        if not tuning.band_via_sparse(kind, D, min(Sk, last - first + 1), Hq != Hkv, blocks):
            return None
        if sparse._ws_config(kind, B * (Hq if kind == "fwd" else Hkv), 128, q, k, v, *more) is None:
            return None
        if torch.cuda.is_current_stream_capturing():  # building a mask synchronises: not inside a graph
            return None
    return sparse.band_mask(Sq, Sk, lo, hi, q.device)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"expected q (B, Hq, Sq, D), k and v (B, Hkv, Sk, D); got {q.shape}, {k.shape}, {v.shape}")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"Hq ({q.shape[1]}) must be a multiple of Hkv ({k.shape[1]})")
    if q.shape[3] > 256:
        raise ValueError(f"the triton backend supports head dims up to 256, got {q.shape[3]}")


def _forward_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    lo: int | None,
    hi: int | None,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check(q, k, v)
    bm = _band_mask("fwd", q, k, v, lo, hi)
    if bm is not None:
        from longctx.launchers import sparse

        return sparse._forward_impl(q, k, v, scale, bm.kernel_tensors(), bm.kernel_meta(), softcap)
    B, Hq, Sq, D = q.shape  # q (B, Hq, Sq, D)
    Hkv, Sk = k.shape[1], k.shape[2]  # k, v (B, Hkv, Sk, D)
    out = out_like(q)  # (B, S, H, D) inputs, dense or packed views, give contiguous (B, S, H, D) outputs
    lse = torch.empty((B, Hq, Sq), device=q.device, dtype=torch.float32)
    if out.numel() == 0:
        return out, lse
    if Sk == 0:
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    bd = tuning.block_d(D)
    lo_i, hi_i, has_lo, has_hi = _band_args(Band(lo, hi))
    ws_config = _ws_config(D, Sq, Sk, has_lo, has_hi) if _ws_ok(q, k, v) else None
    if ws_config is not None:
        try:
            _forward_ws(q, k, v, out, lse, scale, lo_i, hi_i, has_lo, has_hi, ws_config, softcap)
            return out, lse
        except Exception as exc:  # Gluon is experimental: a Triton whose Gluon changed fails at compile time
            if type(exc).__name__ != "CompilationError":
                raise
            _disable_ws(exc)
    longest_first = has_hi and not has_lo
    use_tma, tma_host = tuning.fwd_kv_loads(
        min(Sq, Sk), _tma_ok(k, D, bd) and _tma_ok(v, D, bd), any(t.stride(i) == 0 for t in (k, v) for i in range(3))
    )
    desc_k, desc_v = k, v  # unused by the kernel unless TMA_HOST
    if tma_host:
        from triton.tools.tensor_descriptor import TensorDescriptor

        # the block shape is set per config before each launch (`_fwd_desc_block`)
        desc_k, desc_v = (TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, 16, bd]) for t in (k, v))
    elif use_tma:
        _set_tma_allocator()
    qk_scale, softcap_scale = _score_scales(scale, softcap)
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
            qk_scale=qk_scale,
            softcap_scale=softcap_scale,
            SEQ_BUCKET=tuning.seq_bucket(max(Sq, Sk)),
            HEAD_DIM=D,
            BLOCK_D=bd,
            HAS_LO=has_lo,
            HAS_HI=has_hi,
            SOFTCAP=softcap != 0,
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
    launch(
        flash_bwd.bwd_preprocess_kernel,
        (_cdiv(Sq, pre_bm), B * Hq),
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
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check(q, k, v)
    bm = None if deterministic else _band_mask("bwd", q, k, v, lo, hi, do)
    if bm is not None:
        from longctx.launchers import sparse

        return sparse._backward_impl(
            do, q, k, v, out, lse, dlse, scale, bm.kernel_tensors(), bm.kernel_meta(), False, softcap, grad_dtype
        )
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    # The kernels store through the pointers' dtype: float32 gradients come at no extra pass.
    dq = torch.empty_like(q, dtype=grad_dtype or q.dtype)
    dk = torch.empty_like(k, dtype=grad_dtype or k.dtype)
    dv = torch.empty_like(v, dtype=grad_dtype or v.dtype)
    if dq.numel() == 0 or dk.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    bd = tuning.block_d(D)
    lo_i, hi_i, has_lo, has_hi = _band_args(Band(lo, hi))
    if _interpret():
        _patch_interpreter_for_numpy2()
    ws_config = None
    if (
        not deterministic
        and _ws_wanted("bwd") is not False
        and B * Hkv <= 65535  # the second grid dimension
        and _ws_inputs_ok(q, k, v, do)
    ):
        ws_config = _ws_bwd_config(D)
    # the WS kernel loads each head's lse2 / Delta rows by TMA: 16-byte aligned rows, so padded to 4 floats (the
    # D=256 one reads them with pointers, as the Triton dQ kernel after it does)
    wide = ws_config is not None and D == 256
    padded = ws_config is not None and not wide
    delta, lse2 = bwd_preprocess(out, do, lse, dlse, bd, _cdiv(Sq, 4) * 4 if padded else None)
    qk_scale, softcap_scale = _score_scales(scale, softcap)
    common = dict(
        Sq=Sq,
        Sk=Sk,
        GROUP=Hq // Hkv,
        lo=lo_i,
        hi=hi_i,
        qk_scale=qk_scale,
        softcap_scale=softcap_scale,
        sm_scale=float(scale),
        SEQ_BUCKET=tuning.seq_bucket(max(Sq, Sk)),
        HEAD_DIM=D,
        BLOCK_D=bd,
        HAS_LO=has_lo,
        HAS_HI=has_hi,
        SOFTCAP=softcap != 0,
        DOT_PRECISION=_dot_precision(q.dtype),
    )
    # dV and dK in one launch, or in two where the two accumulators do not fit together (`tuning.split_dkdv`)
    split = tuning.get("split_dkdv")
    split = tuning.split_dkdv(bd) if split is None else bool(split)
    # dQ inside the dK/dV kernel (atomics) or by a separate kernel: `tuning.atomic_dq`; never when deterministic or
    # split
    forced = tuning.get("atomic_dq")
    if deterministic or split:
        atomic = False
    elif forced is not None:
        atomic = bool(forced)
    else:
        atomic = tuning.atomic_dq(bd, Sq, Band(lo, hi).is_dense, Hq != Hkv)
    dkdv_done = False
    if wide:
        # dK and dV by the warp-specialised D=256 kernel; dQ by the Triton dQ kernel below
        try:
            _backward_ws_d256(q, k, v, do, delta, lse2, dk, dv, scale, lo_i, hi_i, has_lo, has_hi, ws_config, softcap)
        except Exception as exc:  # as below: warn once, use the Triton kernels
            if type(exc).__name__ != "CompilationError":
                raise
            _disable_ws(exc, backward=True)
        else:
            dkdv_done, atomic = True, False
    elif ws_config is not None:
        dqa = torch.zeros((B, Hq, Sq, D), device=q.device, dtype=torch.float32)
        try:
            _backward_ws(q, k, v, do, delta, lse2, dk, dv, dqa, scale, lo_i, hi_i, has_lo, has_hi, ws_config, softcap)
        except Exception as exc:  # a Triton whose Gluon does not take the kernel: warn once, use the Triton kernels
            if type(exc).__name__ != "CompilationError":
                raise
            _disable_ws(exc, backward=True)
            delta, lse2 = bwd_preprocess(out, do, lse, dlse, bd)  # unpadded rows for the Triton kernels
        else:
            dq.copy_(dqa)  # the kernel already applied the scale
            return dq, dk, dv
    # the float32 accumulator is ours (contiguous): a TMA reduce needs only a CUDA tensor and D == BLOCK_D (rows of
    # 4*D bytes, a multiple of 16)
    dq_tma = atomic and tuning.dq_by_tma_reduce(D) and not _interpret() and q.is_cuda
    if dq_tma:
        _set_tma_allocator()
    dqa = torch.zeros((B, Hq, Sq, D), device=q.device, dtype=torch.float32) if atomic else dq  # (B, Hq, Sq, D)
    dkdv_args = [q, k, v, do, lse2, delta, dk, dv, dqa, *q.stride(), *k.stride(), *v.stride(), *do.stride()]
    dkdv_args += [*dk.stride(), *dv.stride(), *dqa.stride()[:3]]
    with_dq = dict(ATOMIC_DQ=atomic, DQ_TMA=dq_tma)
    if dkdv_done:
        launches = []
    elif split:
        launches = [("dv", dict(WANT_DK=False, **with_dq)), ("dk", dict(WANT_DV=False, **with_dq))]
    else:
        launches = [("dkdv_atomic" if atomic else "dkdv", with_dq)]
    for kind, flags in launches:
        _launch(kind, bd, lambda bm, bn: (B * Hkv, _cdiv(Sk, bn)), dkdv_args, dict(Hq=Hq, Hkv=Hkv, **flags, **common))
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


# -- the launchers of the contract (longctx.launchers) --


def triton_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, band: Band, softcap: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention forward with the Triton kernel; no autograd.

    Args:
        q: (B, Hq, Sq, D); k, v: (B, Hkv, Sk, D), any strides (the (B, S, H, D) layout needs no copy).
        scale: multiplies q . k.
        band: `Band` (lo <= j - i <= hi), any integer bounds, e.g. ``band.shifted(delta)`` from a ring step.
        softcap: if > 0, the scaled scores become ``softcap * tanh(scores / softcap)`` before the mask; 0 is off.

    Returns:
        out (B, Hq, Sq, D) in q's dtype and memory layout; lse (B, Hq, Sq) float32, natural log, -inf on
        rows that see no key (their output is 0).
    """
    return _forward_impl(q, k, v, float(scale), band.lo, band.hi, float(softcap))


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
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention backward with the Triton kernels: ``(dq, dk, dv)`` in the input dtypes and layouts.

    ``lse`` is the forward's (natural log). ``dlse`` (B, Hq, Sq), optional, is a gradient flowing into the
    lse itself. By default dQ is accumulated in float32 in no fixed order (fast, not bitwise repeatable);
    ``deterministic=True`` uses a separate dQ kernel instead, without atomics (callers fold the user switch
    ``LONGCTX_DETERMINISTIC`` in: `longctx.switches`). ``grad_dtype`` (e.g. float32) writes the
    gradients in that dtype instead of the inputs': context parallelism sums per-block gradients and must not round
    each one to bf16 first. ``softcap`` is the forward's (0: off).
    """
    return _backward_impl(
        do, q, k, v, out, lse, dlse, float(scale), band.lo, band.hi, deterministic, grad_dtype, float(softcap)
    )
