"""Launchers of the block-sparse kernels: `sparse_forward` and `sparse_backward` (lse natural log, float32, -inf on
rows that see nothing). The backward's Delta / base-2 lse come from the dense backward's preprocessing kernel
(`longctx.launchers.flash.bwd_preprocess`).

Kernels: on Hopper, fp16/bf16 inputs with head dim 64 or 128 and a mask block that is a multiple of 128 take the
warp-specialised, persistent Gluon kernels (`longctx.kernels.gluon.flash_sparse_ws`); at head dim 256, its forward,
and for the backward the warp-specialised dK/dV kernel of `longctx.kernels.gluon.flash_bwd_ws_d256` with the Triton
dQ kernel (`tuning.sparse_ws_config`). Their backward adds dQ by the copy engine's bulk reduction (not in a fixed
order), so ``deterministic=True`` keeps the Triton kernels (`longctx.kernels.triton.flash_sparse`), which serve
every other input too, and take over where a Triton version does not compile the Gluon kernels. The persistent
kernels take their work items in `_schedule`'s order (heads in order, the longest items first within a head), kept
per mask (`_schedule_cached`).

Tiles of the Triton kernels: the entry of `longctx.tuning.sparse_tile_choices` that `tuning.MEASURED_TILES` names
for this GPU (autotuned over the first two at run time only with ``LONGCTX_TUNING=autotune=1``); the Gluon kernels'
configs: `longctx.tuning.sparse_ws_config`. Developer overrides
(`longctx.tuning`, docs/tuning.md): ``sparse_ws`` / ``sparse_ws_bwd`` (False: the Triton kernels),
``sparse_tiles`` (forced Triton tiles), ``sparse_tma_in_interpreter``. The mask's block size must be a multiple of
16 (tl.dot's minimum); the backend runs other block sizes on the plain-PyTorch path (`longctx.reference`).

Logit softcapping (``softcap > 0``): the same kernels as without it (Gluon or Triton, chosen by the same rules),
compiled with SOFTCAP set (score factors from `launchers.flash._score_scales`).
"""

from __future__ import annotations

import collections
import functools

import torch

from longctx import tuning
from longctx.launchers import flash as _tf
from longctx.launchers import runtime
from longctx.masks import Band, BlockMask
from longctx.masks.build import band_block_mask

__all__ = ["sparse_forward", "sparse_backward"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _tile_choices(kind: str, bd: int, mask_bs: int) -> list[tuple[int, int, int, int]]:
    return tuning.sparse_tile_choices(kind, bd, mask_bs, interpret=runtime._interpret())


def _forced_tiles() -> dict[str, tuple[int, int, int, int]]:
    """The ``sparse_tiles`` override: kind -> (BLOCK_M, BLOCK_N, num_warps, num_stages), from a dict or from text
    ``"fwd:128x64x8x3;dkdv:64x128x8x3"``; empty in normal use."""
    val = tuning.get("sparse_tiles")
    if not val:
        return {}
    if isinstance(val, dict):
        return {k: tuple(v) for k, v in val.items()}
    out = {}
    for part in filter(None, (p.strip() for p in str(val).split(";"))):
        kind, _, cfg = part.partition(":")
        vals = tuple(int(x) for x in cfg.split("x")) if cfg else ()
        if kind.strip() not in ("fwd", "dkdv", "dq") or len(vals) != 4:
            raise ValueError(
                f"sparse_tiles entry {part!r}: expected kind:BLOCK_MxBLOCK_Nxnum_warpsxnum_stages with kind fwd, dkdv "
                "or dq, e.g. 'fwd:128x64x8x3;dkdv:64x128x8x3'"
            )
        out[kind.strip()] = vals
    return out


def _kernel_fn(kind: str):
    from longctx.kernels.triton import flash_sparse

    if runtime._interpret():
        runtime._patch_interpreter_for_numpy2()
    return {
        "fwd": flash_sparse.sparse_fwd_kernel,
        "dkdv": flash_sparse.sparse_bwd_dkdv_kernel,
        "dq": flash_sparse.sparse_bwd_dq_kernel,
    }[kind]


@functools.cache
def _kernel(kind: str, bd: int, mask_bs: int):
    import triton

    fn = _kernel_fn(kind)
    if not _tf._autotune_enabled():
        return fn
    cfgs = [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
        for bm, bn, w, s in _tile_choices(kind, bd, mask_bs)[:2]
    ]
    # USE_TMA is in the key: a tile that suits the descriptor loads may not fit the pointer loads' shared memory
    key = ["HEAD_DIM", "MASK_KIND", "HAS_DOC", "HAS_GLOBAL", "SEQ_BUCKET"] + (["USE_TMA"] if kind == "fwd" else [])
    return triton.autotune(cfgs, key=key)(fn)


def _launch(kind: str, bd: int, mask_bs: int, grid_fn, args: list, kwargs: dict) -> None:
    forced = _forced_tiles().get(kind)
    if forced is not None:
        bm, bn, w, s = forced
        runtime.launch(
            _kernel_fn(kind), grid_fn(bm, bn), *args, **kwargs, BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s
        )
        return
    kernel = _kernel(kind, bd, mask_bs)
    if _tf._autotune_enabled():
        kernel[lambda meta: grid_fn(meta["BLOCK_M"], meta["BLOCK_N"])](*args, **kwargs)
        return
    choices = _tile_choices(kind, bd, mask_bs)
    if runtime._interpret():
        bm, bn, w, s = choices[0]
    else:
        key = tuning.sparse_tile_key(kind, bd, mask_bs, kwargs["SEQ_BUCKET"])
        gpu = runtime.gpu_name(runtime.device_index(args[0]))
        bm, bn, w, s = choices[tuning.measured_index(gpu, key, len(choices))]
    runtime.launch(kernel, grid_fn(bm, bn), *args, **kwargs, BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s)


def _grid(n_heads: int, n_tiles):
    """Grid function of (BLOCK_M, BLOCK_N): (tiles, heads), the tile index fastest (K/V or q/dO shared in L2)."""
    return lambda bm_, bn_: (n_tiles(bm_, bn_), n_heads)


def _tma_ok(t: torch.Tensor, D: int, bd: int) -> bool:
    """Whether rows of t (B, H, S, D) can be read through tensor descriptors (`runtime._tma_ok`)."""
    return runtime._tma_ok(t, D, bd, in_interpreter=tuning.get("sparse_tma_in_interpreter"))


def _mask_args(mt: tuple, meta: list, B: int, Hq: int, transposed: bool) -> tuple[list, dict]:
    """Pointer/stride arguments of the mask (``BlockMask.kernel_tensors`` / ``kernel_meta``); the lists are
    expanded to (B, Hq, ...) with stride-0 broadcasting."""
    kvn, kvi, fkvn, fkvi, qn, qi, fqn, fqi, qd, kd, qp, kp, tiles, tile_ids = mt
    _, _, _, kind, lo, hi, kv_global, q_global, has_doc = meta
    num, idx, fnum, fidx = (qn, qi, fqn, fqi) if transposed else (kvn, kvi, fkvn, fkvi)
    num, fnum = num.expand(B, Hq, num.shape[-1]), fnum.expand(B, Hq, fnum.shape[-1])
    idx, fidx = idx.expand(B, Hq, *idx.shape[-2:]), fidx.expand(B, Hq, *fidx.shape[-2:])
    assert num.stride() == fnum.stride() and idx.stride() == fidx.stride() and idx.stride(-1) == 1
    kw: dict = dict(lo=0, hi=0, kv_global=0, q_global=0, MASK_KIND=0, HAS_DOC=False, HAS_GLOBAL=False)
    s_qdoc = s_kdoc = 0
    ts = (0, 0, 0)
    if kind in (1, 3):
        # (Bd, S) int32, contiguous; Bd == 1 broadcasts over the batch
        s_qdoc = qd.stride(0) if qd.shape[0] > 1 else 0
        s_kdoc = kd.stride(0) if kd.shape[0] > 1 else 0
    if kind == 1:
        kw.update(
            lo=lo,
            hi=hi,
            kv_global=kv_global,
            q_global=q_global,
            MASK_KIND=1,
            HAS_DOC=bool(has_doc),
            HAS_GLOBAL=bool(kv_global or q_global),
        )
    elif kind == 3:
        # per-token intervals in the slots of the ids and positions (`DocBand.intervals`); HAS_DOC: both are read
        kw.update(MASK_KIND=3, HAS_DOC=True)
    elif kind == 2:
        tile_ids = tile_ids.expand(B, Hq, *tile_ids.shape[-2:])
        ts = (tile_ids.stride(0), tile_ids.stride(1), tile_ids.stride(2))
        kw.update(MASK_KIND=2)
    args = [num, idx, fnum, fidx, num.stride(0), num.stride(1), idx.stride(0), idx.stride(1), idx.stride(2)]
    args += [qd, kd, qp, kp, s_qdoc, s_kdoc, tiles, tile_ids, *ts]
    return args, kw


def _check(q, k, v, meta: list) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"expected q (B, Hq, Sq, D), k and v (B, Hkv, Sk, D); got {q.shape}, {k.shape}, {v.shape}")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"Hq ({q.shape[1]}) must be a multiple of Hkv ({k.shape[1]})")
    if meta[0] % 16:
        raise ValueError(f"the triton_sparse kernels need a block_size that is a multiple of 16, got {meta[0]}")
    if q.shape[3] > 256:
        raise ValueError(f"head dims up to 256 are supported, got {q.shape[3]}")
    if (q.shape[2], k.shape[2]) != (meta[1], meta[2]):
        raise ValueError(f"the mask was built for Sq={meta[1]}, Sk={meta[2]}; got Sq={q.shape[2]}, Sk={k.shape[2]}")


# kinds ("fwd", "bwd") whose Gluon kernel failed to compile with this Triton: the Triton kernels from then on
_WS_BROKEN: set[str] = set()


def _ws_config(kind: str, n_heads: int, mask_bs: int, *tensors: torch.Tensor) -> tuple | None:
    """The warp-specialised kernel's config for these inputs (`tuning.sparse_ws_config`), or None where the Triton
    kernels run: switched off (tuning key ``sparse_ws`` / ``sparse_ws_bwd``) or failed to compile, a mask block that
    is not a multiple of the kernels' 128 rows, 2^31 work items or more (their int32 index), or inputs the Gluon
    kernels do not take (`launchers.flash._ws_inputs_ok`: fp16/bf16, head dim 64, 128 or 256, sm_90, TMA-loadable
    strides), or a head dim without a config of this kind."""
    n_items = n_heads * _cdiv(max(tensors[0].shape[2], tensors[1].shape[2]), 128)
    if tuning.get("sparse_ws" if kind == "fwd" else "sparse_ws_bwd") is False or kind in _WS_BROKEN:
        return None
    if mask_bs % 128 or n_items >= 2**31 or not _tf._ws_inputs_ok(*tensors):
        return None
    return tuning.sparse_ws_config(kind, tensors[0].shape[3])


def _ws_failed(kind: str, exc: Exception) -> None:
    """A Gluon kernel that does not compile with this Triton: warn once, use the Triton kernels from now."""
    if type(exc).__name__ != "CompilationError":
        raise exc
    _WS_BROKEN.add(kind)
    runtime.warn_ws_fallback(f"block-sparse {'forward' if kind == 'fwd' else 'backward'}", exc)


def _schedule(num: torch.Tensor, fnum: torch.Tensor, n_tiles: int, rows: int, mask_bs: int, group: int):
    """The order of a warp-specialised kernel's work items ``tile + n_tiles * head`` (tiles of ``rows`` rows or
    keys): heads in order, and within each head the tiles with the most mask blocks first (a stable sort, so equal
    work keeps the tiles' order). The items in flight stay within one or two heads (K/V or Q/dO shared in L2), and
    each head ends with its shortest items, so the kernel's last wave is short (packed documents: the first key
    block of a long document sees all of it). num / fnum: (B, H, n_blocks) block counts, H summed in groups of
    ``group`` (the query heads of one kv head, backward)."""
    B, H, nb = num.shape
    work = (num + fnum).reshape(B, H // group, group, nb).sum(2)  # (B, grid heads, mask blocks)
    blk = torch.arange(n_tiles, device=num.device) * rows // mask_bs
    work = work[:, :, blk].reshape(-1, n_tiles)  # (B * grid heads, tiles)
    order = torch.argsort(-work, dim=1, stable=True)
    order += torch.arange(work.shape[0], device=num.device)[:, None] * n_tiles
    return order.reshape(-1).to(torch.int32)


_SCHEDULES: collections.OrderedDict = collections.OrderedDict()
_SCHEDULES_MAX = 64


def _schedule_cached(num: torch.Tensor, fnum: torch.Tensor, n_tiles: int, rows: int, mask_bs: int, group: int):
    """`_schedule`, kept for the next call with the same mask tensors (a mask serves every layer and both passes;
    computing the order takes about ten small kernels, a large share of a short forward's host time). Keyed by
    the tensors' storage, version and shapes: an entry left by a freed mask whose memory a new mask of the same
    shape took is still an order of the same work items, so only the speed can suffer, never the result."""
    key = (num.data_ptr(), fnum.data_ptr(), num._version, fnum._version, tuple(num.shape), tuple(num.stride()),
           tuple(fnum.stride()), num.device, n_tiles, rows, mask_bs, group)  # fmt: skip
    hit = _SCHEDULES.get(key)
    if hit is not None:
        _SCHEDULES.move_to_end(key)
        return hit
    order = _schedule(num, fnum, n_tiles, rows, mask_bs, group)
    if not (num.is_cuda and torch.cuda.is_current_stream_capturing()):  # a graph's memory is not ours to keep
        _SCHEDULES[key] = order
        while len(_SCHEDULES) > _SCHEDULES_MAX:
            _SCHEDULES.popitem(last=False)
    return order


_BAND_MASKS: collections.OrderedDict = collections.OrderedDict()
# the kept band masks hold at most this many (query block x key block) entries in all: 16 bytes each in their lists
_BAND_MASKS_BLOCKS = 2**22


def band_mask(sq: int, sk: int, lo: int | None, hi: int | None, device: torch.device) -> BlockMask:
    """The `BlockMask` of the band ``lo <= j - i <= hi`` over Sq queries and Sk keys, in 128-blocks (the
    warp-specialised kernels' rows), kept for the next call with the same band (every layer and both passes take
    it; the steps of a ring take a few shifted ones). Building one synchronises with the GPU, so the kept masks are
    bounded by their size, not by their number."""
    key = (sq, sk, lo, hi, device)
    hit = _BAND_MASKS.get(key)
    if hit is not None:
        _BAND_MASKS.move_to_end(key)
        return hit
    bm = band_block_mask(Band(lo, hi), sq, sk, 128, device)
    _BAND_MASKS[key] = bm
    blocks = lambda m: m.block_kind.shape[-2] * m.block_kind.shape[-1]  # noqa: E731
    while len(_BAND_MASKS) > 1 and sum(blocks(m) for m in _BAND_MASKS.values()) > _BAND_MASKS_BLOCKS:
        _BAND_MASKS.popitem(last=False)
    return bm


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _work_grid(n_items: int, device: torch.device) -> tuple[tuple[int], torch.Tensor]:
    """(grid, ticket counter) of a persistent launch over ``n_items`` work items: at most one CTA per SM (the
    kernels' shared memory allows no second) and a zeroed counter from which they take the items after their
    first."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    return (min(n_items, _num_sms(idx)),), torch.zeros(1, dtype=torch.int32, device=device)


def _forward_ws(q, k, v, out, lse, scale: float, margs: list, mkw: dict, mask_bs: int, config, softcap=0.0) -> None:
    """Launch `flash_sparse_ws.sparse_fwd_ws_kernel` (conditions and config: `_ws_config`); ``softcap`` != 0 compiles
    it with SOFTCAP."""
    from longctx.kernels.gluon import flash_sparse_ws as sws

    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    block_n, stages, pipe = config
    n_tiles = _cdiv(Sq, int(sws.CTA_ROWS))
    grid, cnt = _work_grid(n_tiles * B * Hq, q.device)
    sched = _schedule_cached(margs[0], margs[2], n_tiles, int(sws.CTA_ROWS), mask_bs, 1)
    qk_scale, softcap_scale = _tf._score_scales(scale, softcap)
    runtime.launch(
        sws.sparse_fwd_ws_kernel, grid,
        runtime._gluon_desc(q, int(sws.WG_ROWS)), runtime._gluon_desc(k, block_n), runtime._gluon_desc(v, block_n),
        runtime._gluon_desc(out, int(sws.WG_ROWS)), lse, *margs, sched, cnt, n_tiles * B * Hq, n_tiles,
        Hq=Hq, Sq=Sq, Sk=Sk, GROUP=Hq // Hkv, qk_scale=qk_scale, softcap_scale=softcap_scale,
        BLOCK_D=D, MASK_BS=mask_bs, EVEN_SK=Sk % mask_bs == 0, BLOCK_N=block_n, STAGES=stages, PIPE=pipe,
        CONSUMER_REGS=240, PRODUCER_REGS=24, SOFTCAP=softcap != 0, num_warps=4, maxnreg=168, **mkw,
    )  # fmt: skip


def _backward_ws(
    q, k, v, do, delta, lse2, dk, dv, dqa, scale: float, targs: list, tkw: dict, mask_bs: int, config, softcap=0.0
):
    """Launch `flash_sparse_ws.sparse_bwd_ws_kernel`: dK, dV into ``dk`` / ``dv``, scale * dS K added into ``dqa``
    (float32, zeroed, contiguous); lse2 / Delta with rows padded to 4 floats (`launchers.flash.bwd_preprocess`);
    ``softcap`` != 0 compiles it with SOFTCAP."""
    from longctx.kernels.gluon import flash_sparse_ws as sws

    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    block_m, stages, early_dv = config
    rows = int(sws.CTA_ROWS)
    n_tiles = _cdiv(Sk, rows)
    grid, cnt = _work_grid(n_tiles * B * Hkv, q.device)
    sched = _schedule_cached(targs[0], targs[2], n_tiles, rows, mask_bs, Hq // Hkv)
    # dK / dV leave by the copy engine where the query tiles have 64 rows and the gradients 16 bits
    # (`flash_sparse_ws._bwd_item`); else the descriptor slots take unused placeholders
    dkdv16 = dk.dtype in (torch.float16, torch.bfloat16)
    dkdv_tma = block_m != rows and dkdv16
    desc_dk, desc_dv = [runtime._gluon_desc(t, int(sws.WG_ROWS)) for t in (dk, dv)] if dkdv_tma else [dk, dv]
    qk_scale, softcap_scale = _tf._score_scales(scale, softcap)
    runtime.launch(
        sws.sparse_bwd_ws_kernel, grid,
        runtime._gluon_desc(q, block_m), runtime._gluon_desc(k, rows), runtime._gluon_desc(v, rows),
        runtime._gluon_desc(do, block_m),
        runtime._gluon_rows_desc(lse2, block_m), runtime._gluon_rows_desc(delta, block_m),
        dk, dv, dqa, _tf._dqa_desc(dqa, block_m, D),
        desc_dk, desc_dv, *dk.stride(), *dv.stride(), *dqa.stride()[:3], *targs, sched, cnt,
        n_tiles * B * Hkv, n_tiles, Hq=Hq, Hkv=Hkv, Sq=Sq, Sk=Sk, GROUP=Hq // Hkv, stride_lse=lse2.shape[2],
        qk_scale=qk_scale, sm_scale=scale, softcap_scale=softcap_scale, BLOCK_D=D, MASK_BS=mask_bs,
        EVEN=Sq % mask_bs == 0 and Sk % mask_bs == 0, BLOCK_M=block_m, STAGES=stages, EARLY_DV=early_dv,
        CONSUMER_REGS=240, PRODUCER_REGS=24, SOFTCAP=softcap != 0, DKDV_16BIT=dkdv16, num_warps=4, maxnreg=168,
        **tkw,
    )  # fmt: skip


def _backward_ws_d256(
    q, k, v, do, delta, lse2, dk, dv, scale: float, targs: list, tkw: dict, mask_bs: int, config, softcap=0.0
):
    """Launch `flash_bwd_ws_d256.sparse_bwd_dkdv_ws_d256_kernel`: dK, dV into ``dk`` / ``dv`` (dQ is the Triton
    block-sparse dQ kernel's); lse2 / Delta unpadded; config from `tuning.sparse_ws_config` (its STAGES)."""
    from longctx.kernels.gluon import flash_bwd_ws_d256 as wide

    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    rows, cta = int(wide.BLOCK_M), int(wide.BLOCK_N)
    qk_scale, softcap_scale = _tf._score_scales(scale, softcap)
    runtime.launch(
        wide.sparse_bwd_dkdv_ws_d256_kernel, (_cdiv(Sk, cta), B * Hkv),
        runtime._gluon_desc(q, rows), runtime._gluon_desc(k, cta), runtime._gluon_desc(v, cta),
        runtime._gluon_desc(do, rows), lse2, delta, dk, dv, *dk.stride(), *dv.stride(), *targs,
        Hq=Hq, Hkv=Hkv, Sq=Sq, Sk=Sk, GROUP=Hq // Hkv, qk_scale=qk_scale, sm_scale=scale,
        softcap_scale=softcap_scale, BLOCK_D=D, MASK_BS=mask_bs, EVEN=Sq % mask_bs == 0 and Sk % mask_bs == 0,
        STAGES=config[1], CONSUMER_REGS=240, PRODUCER_REGS=24, SOFTCAP=softcap != 0, num_warps=4, maxnreg=168, **tkw,
    )  # fmt: skip


def _forward_impl(
    q, k, v, scale: float, mt: tuple, meta: list, softcap: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    _check(q, k, v, meta)
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    mask_bs = meta[0]
    out = runtime.out_like(q)  # (B, S, H, D) inputs give contiguous (B, S, H, D) outputs
    lse = torch.empty((B, Hq, Sq), device=q.device, dtype=torch.float32)
    if out.numel() == 0:
        return out, lse
    bd = tuning.block_d(D)
    margs, mkw = _mask_args(mt, meta, B, Hq, transposed=False)
    ws = _ws_config("fwd", B * Hq, mask_bs, q, k, v)
    if ws is not None:
        try:
            _forward_ws(q, k, v, out, lse, scale, margs, mkw, mask_bs, ws, softcap)
            return out, lse
        except Exception as exc:  # Gluon is experimental: another Triton may not compile the kernel
            _ws_failed("fwd", exc)
    # Sq or Sk below 16: pointer loads (the dense launcher's ptxas crash at D=256; nothing to gain on such inputs)
    use_tma = min(Sq, Sk) >= 16 and _tma_ok(k, D, bd) and _tma_ok(v, D, bd)
    if use_tma:
        runtime._set_tma_allocator()
    qk_scale, softcap_scale = _tf._score_scales(scale, softcap)
    _launch(
        "fwd",
        bd,
        mask_bs,
        _grid(B * Hq, lambda bm_, bn_: _cdiv(Sq, bm_)),
        [q, k, v, out, lse, *q.stride(), *k.stride(), *v.stride(), *out.stride(), *margs],
        dict(
            USE_TMA=use_tma,
            Hq=Hq,
            Sq=Sq,
            Sk=Sk,
            GROUP=Hq // Hkv,
            qk_scale=qk_scale,
            softcap_scale=softcap_scale,
            SEQ_BUCKET=tuning.seq_bucket(max(Sq, Sk)),
            HEAD_DIM=D,
            BLOCK_D=bd,
            MASK_BS=mask_bs,
            SOFTCAP=softcap != 0,
            EVEN_SK=Sk % mask_bs == 0,
            DOT_PRECISION=runtime._dot_precision(q.dtype),
            **mkw,
        ),
    )
    return out, lse


def _backward_impl(
    do,
    q,
    k,
    v,
    out,
    lse,
    dlse,
    scale: float,
    mt: tuple,
    meta: list,
    deterministic: bool = False,
    softcap: float = 0.0,
    grad_dtype: torch.dtype | None = None,
):
    _check(q, k, v, meta)
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    mask_bs = meta[0]
    # the kernels store through the pointers' dtype: float32 gradients (context parallelism's partial sums) cost no
    # extra pass
    dq, dk, dv = (torch.empty_like(t, dtype=grad_dtype or t.dtype) for t in (q, k, v))
    if dq.numel() == 0 or dk.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    bd = tuning.block_d(D)
    if runtime._interpret():
        runtime._patch_interpreter_for_numpy2()
    nondet = not deterministic
    ws = _ws_config("bwd", B * Hkv, mask_bs, q, k, v, do) if nondet else None
    # D=256: the warp-specialised dK / dV kernel (a (key tiles, B * Hkv) grid: at most 65535 heads), then the Triton
    # dQ kernel
    wide = ws is not None and D == 256
    if wide and B * Hkv > 65535:
        ws, wide = None, False
    # (B, Hq, Sq) each; for the warp-specialised kernel each head's rows padded to 4 floats (TMA alignment; the D=256
    # one reads them with pointers, as the Triton dQ kernel after it)
    delta, lse2 = _tf.bwd_preprocess(out, do, lse, dlse, bd, _cdiv(Sq, 4) * 4 if ws is not None and not wide else None)
    # the transposed lists, for whichever kernel computes dK / dV
    targs, tkw = _mask_args(mt, meta, B, Hq, transposed=True)
    dkdv_done = False
    if wide:
        try:
            _backward_ws_d256(q, k, v, do, delta, lse2, dk, dv, scale, targs, tkw, mask_bs, ws, softcap)
        except Exception as exc:
            _ws_failed("bwd", exc)
        else:
            dkdv_done = True
    elif ws is not None:
        dqa = torch.zeros((B, Hq, Sq, D), device=q.device, dtype=torch.float32)
        try:
            _backward_ws(q, k, v, do, delta, lse2, dk, dv, dqa, scale, targs, tkw, mask_bs, ws, softcap)
        except Exception as exc:
            _ws_failed("bwd", exc)
            delta, lse2 = _tf.bwd_preprocess(out, do, lse, dlse, bd)  # unpadded rows for the Triton kernels
        else:
            dq.copy_(dqa)  # the kernel applied the scale
            return dq, dk, dv
    qk_scale, softcap_scale = _tf._score_scales(scale, softcap)
    common = dict(
        Sq=Sq,
        Sk=Sk,
        GROUP=Hq // Hkv,
        qk_scale=qk_scale,
        softcap_scale=softcap_scale,
        sm_scale=float(scale),
        SEQ_BUCKET=tuning.seq_bucket(max(Sq, Sk)),
        HEAD_DIM=D,
        BLOCK_D=bd,
        MASK_BS=mask_bs,
        SOFTCAP=softcap != 0,
        DOT_PRECISION=runtime._dot_precision(q.dtype),
    )
    # -- dK / dV: one kv tile per program over the transposed lists; then dQ: one query tile over the lists --
    if not dkdv_done:
        _launch(
            "dkdv",
            bd,
            mask_bs,
            _grid(B * Hkv, lambda bm_, bn_: _cdiv(Sk, bn_)),
            [q, k, v, do, lse2, delta, dk, dv, *q.stride(), *k.stride(), *v.stride(), *do.stride()]
            + [*dk.stride(), *dv.stride(), *targs],
            dict(Hq=Hq, Hkv=Hkv, **common, **tkw),
        )
    margs, mkw = _mask_args(mt, meta, B, Hq, transposed=False)
    _launch(
        "dq",
        bd,
        mask_bs,
        _grid(B * Hq, lambda bm_, bn_: _cdiv(Sq, bm_)),
        [q, k, v, do, lse2, delta, dq, *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dq.stride(), *margs],
        dict(Hq=Hq, EVEN_SK=Sk % mask_bs == 0, **common, **mkw),
    )
    return dq, dk, dv


def sparse_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, block_mask: BlockMask, softcap: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-sparse forward: q (B, Hq, Sq, D), k/v (B, Hkv, Sk, D), any strides -> out (q's layout), lse (B, Hq, Sq).
    ``softcap > 0`` caps the scaled scores to ``softcap * tanh(scores / softcap)``."""
    block_mask.check_compatible(q, k)
    return _forward_impl(q, k, v, float(scale), block_mask.kernel_tensors(), block_mask.kernel_meta(), float(softcap))


def sparse_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    scale: float,
    block_mask: BlockMask,
    dlse: torch.Tensor | None = None,
    deterministic: bool = False,
    softcap: float = 0.0,
    grad_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block-sparse backward: (dq, dk, dv) in the input dtypes and layouts (``grad_dtype``, e.g. float32, when
    given). With ``deterministic`` (or ``LONGCTX_DETERMINISTIC=1``) bitwise repeatable (the Triton kernels, no
    atomics); else the warp-specialised kernels may run, which add dQ by a bulk reduction in no fixed order.
    ``softcap``: the forward's (0: off)."""
    block_mask.check_compatible(q, k)
    mt, meta = block_mask.kernel_tensors(), block_mask.kernel_meta()
    return _backward_impl(
        do, q, k, v, out, lse, dlse, float(scale), mt, meta, deterministic, float(softcap), grad_dtype
    )
