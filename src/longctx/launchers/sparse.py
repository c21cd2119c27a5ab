"""The `triton_sparse` backend: block-sparse masks and packed documents on the Triton kernels.

Layers, bottom up (kernels in `longctx.kernels.triton.flash_sparse`):

- `sparse_forward(q, k, v, *, scale, block_mask) -> (out, lse)` and
  `sparse_backward(do, q, k, v, out, lse, *, scale, block_mask, dlse=None) -> (dq, dk, dv)`: the launchers
  (lse natural log, float32, -inf on rows that see nothing). The backward's Delta / base-2 lse come from the
  `triton` backend's preprocessing kernel (`longctx.kernels.flash_bwd.bwd_preprocess_kernel`).
- ``torch.ops.longctx.triton_sparse_fwd`` / ``triton_sparse_bwd``: the same, registered with `torch.library`
  (fake implementations and autograd included) so `torch.compile` traces a model through them without a graph
  break. A BlockMask is not a valid op argument: the ops take its `BlockMask.kernel_tensors` (``Tensor[]``)
  and `BlockMask.kernel_meta` (``int[]``); `triton_sparse_attention` unpacks the mask and calls the op.
- `TritonSparseBackend`: name "triton_sparse", family "flash" (``LONGCTX_FLASH_ATTN=0`` switches it off),
  second in the auto order right after "triton". It serves only calls with a block mask (and the packed
  documents of `longctx.flash_attn_varlen_func`, which are one); dense calls go to "triton".

Tiles: the kernels' BLOCK_M/BLOCK_N come from `_SPARSE_TABLES` (measured for D=128) or else the `triton`
backend's tables (`longctx.tuning`), kept only where they divide the mask's block size; autotuned
over the first two such entries unless ``LONGCTX_TRITON_AUTOTUNE=0``. The mask's block size must be a
multiple of 16 (tl.dot's minimum); other block sizes run on the plain-PyTorch path
(`longctx.reference.tiled_sparse`).

Variants (`VARIANT`; the kernels' constexpr flags, described in `longctx.kernels.triton.flash_sparse`), read from the
environment at import: on by default (measured faster) ``LONGCTX_SPARSE_GRID_SWAP``, ``..._PREFETCH_IDX`` and
``..._TMA`` (set to 0 to switch off); off by default (measured slower) ``..._TMA_DQ=1``, ``..._PIPE_QK=1``,
``..._REVERSE_M=1`` and ``LONGCTX_SPARSE_ATOMIC_DQ=ptr|tma`` (never under ``deterministic=True``).
The warp-specialised kernels (`longctx.kernels.gluon.flash_sparse_ws`, Gluon) serve fp16/bf16 inputs with head dim 64 or
128 on Hopper when the mask's block size is a multiple of 128 (`_ws_config`): forward 1.31-1.48x FlexAttention in
the H100 mask table of session 7, against 1.03-1.17x for the Triton forward. Their backward adds dQ by the copy
engine's bulk reduction (not in a fixed order), so ``deterministic=True`` keeps the Triton kernels.
``LONGCTX_SPARSE_WS=0`` / ``LONGCTX_SPARSE_WS_BWD=0`` switch them off. They are persistent (one CTA per SM taking
work items by ticket, in `_schedule`'s order: heads in order, the longest items first within a head);
``LONGCTX_SPARSE_WS_PERSIST=0`` launches one CTA per item, in that order for analytic masks only
(`_use_schedule`); ``LONGCTX_SPARSE_WS_SCHED=1`` / ``0`` takes the order always / never. The order is kept per
mask (`_schedule_cached`). Their forward writes the output through the warpgroup's Q buffer and the copy engine
(``LONGCTX_SPARSE_WS_O_STAGE=1``, persistent only: through a tile of its own, so that Q is freed after the item's
last scores; ``LONGCTX_SPARSE_WS_O_TMA=0``: from registers, and then ``LONGCTX_SPARSE_WS_EARLY_Q=0`` frees Q after
the last P V rather than the last scores).
`WS_TRACE` records each forward item's timeline (benchmarks/diag_items.py --trace).
`FORCE_CONFIG` pins tiles per kernel
(``LONGCTX_SPARSE_TILES="fwd=128,64,8,3;dkdv=32,128,8,3"``) for tuning sessions;
benchmarks/sweep_sparse_configs.py compares the variants against FlexAttention.
"""

from __future__ import annotations

import collections
import functools
import os

import torch

from longctx.launchers import flash as _tf
from longctx.launchers import runtime
from longctx.masks import BlockMask

__all__ = ["sparse_forward", "sparse_backward"]

_LOG2E = 1.4426950408889634


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# Measured on an H100 (benchmarks/sweep_sparse_configs.py, S=16K, D=128, bf16; NOTES.md "Block-sparse"): with the
# prefetched block index and the swapped grid (the defaults since run 7e of 2026-11-21), forward 128x64/8 warps/3
# stages with TMA K/V and dK/dV 64x128/8/3 were the fastest on every mask case (before them, without the
# prefetch, 128x128/8/2 and 64x128/8/2 were). Other head dims use the `triton` backend's tables.
_SPARSE_TABLES = {
    "fwd": {128: [(128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3)]},
    "dkdv": {128: [(64, 128, 8, 3), (64, 128, 8, 2), (64, 64, 4, 3)]},
    "dq": {128: [(128, 64, 8, 3), (128, 64, 8, 2), (64, 32, 4, 4)]},
}


def _tile_choices(kind: str, bd: int, mask_bs: int) -> list[tuple[int, int, int, int]]:
    from longctx import tuning as configs

    if runtime._interpret():
        bm, bn, w, s = configs.INTERPRET
        return [(min(bm, mask_bs), min(bn, mask_bs), w, s)]
    # (tiles only: the dense forward's entries may carry a fifth element, its PIPE_QK choice)
    table = [c[:4] for c in _SPARSE_TABLES[kind].get(bd, []) + configs.table(kind)[bd]]
    ok = list(dict.fromkeys(c for c in table if mask_bs % c[0] == 0 and mask_bs % c[1] == 0))
    if not ok:
        b = 64 if mask_bs % 64 == 0 else 32 if mask_bs % 32 == 0 else 16
        ok = [(b, b, 4, 2)]
    return ok


def _flag(name: str, default: bool = False) -> bool:
    return os.environ.get(name, "1" if default else "0").strip().lower() in ("1", "true", "on", "yes")


def _tristate(name: str) -> bool | str:
    """``auto`` (unset or "auto"), else the flag's value."""
    if os.environ.get(name, "auto").strip().lower() == "auto":
        return "auto"
    return _flag(name)


# Kernel variants (`longctx.kernels.triton.flash_sparse` describes each), read once from the environment. The first
# three
# are on by default (measured faster on every mask case: NOTES.md, "Block-sparse", run 7e); the others measured
# slower and stay off. benchmarks/sweep_sparse_configs.py sets them directly to compare them.
VARIANT: dict = {
    # tile index fastest in every grid (K/V or q/dO shared in L2)
    "grid_swap": _flag("LONGCTX_SPARSE_GRID_SWAP", True),
    "prefetch_idx": _flag("LONGCTX_SPARSE_PREFETCH_IDX", True),  # block-list entries read one iteration ahead
    "tma": _flag("LONGCTX_SPARSE_TMA", True),  # forward: K/V through tensor descriptors (CUDA only)
    "tma_dq": _flag("LONGCTX_SPARSE_TMA_DQ"),  # dQ kernel: K/V through tensor descriptors (CUDA only)
    "pipe_qk": _flag("LONGCTX_SPARSE_PIPE_QK"),  # forward, full blocks: next QK^T issued before the softmax
    "reverse_m": _flag("LONGCTX_SPARSE_REVERSE_M"),  # forward and dQ: the last query tile first
    # "0": separate dQ kernel (deterministic); "ptr": dQ by float32 atomics in the dK/dV kernel; "tma": the same
    # through a TMA reduce (CUDA only; "ptr" elsewhere). Never under deterministic=True / LONGCTX_DETERMINISTIC=1.
    "atomic_dq": os.environ.get("LONGCTX_SPARSE_ATOMIC_DQ", "0").strip().lower(),
    # the warp-specialised kernels (`longctx.kernels.gluon.flash_sparse_ws`, Gluon, Hopper) for the forward and for the
    # backward (dQ by a bulk reduction, not in a fixed order: never under deterministic=True); `_ws_config` says
    # which inputs take them
    "ws": _flag("LONGCTX_SPARSE_WS", True),
    "ws_bwd": _flag("LONGCTX_SPARSE_WS_BWD", True),
    # their CTAs in order of work, the most blocks first within each head (`_schedule`), instead of the grid's
    # order: "auto" (the default; `_use_schedule`), True always, False never
    "ws_sched": _tristate("LONGCTX_SPARSE_WS_SCHED"),
    # persistent: one CTA per SM taking work items by ticket, the next item's loads overlapping this one's end
    "ws_persist": _flag("LONGCTX_SPARSE_WS_PERSIST", True),
    # persistent forward: a consumer frees its Q buffer for the next item once the item's last scores are done
    # (where no partial block follows), not after its last P V
    "ws_early_q": _flag("LONGCTX_SPARSE_WS_EARLY_Q", True),
    # forward: the output leaves through the warpgroup's Q buffer and the copy engine (then Q is freed only once
    # the copy has read it, so not with ws_early_q unless ws_o_stage), not by strided stores from registers
    "ws_o_tma": _flag("LONGCTX_SPARSE_WS_O_TMA", True),
    # persistent forward with ws_o_tma: the output through a shared tile of its own, so Q is freed after the last
    # scores (ws_early_q) and no epilogue waits for its copy; where shared memory runs short (D=128) the V ring
    # has a slot fewer. Off by default: at D=128 the 10% layout's kernel time did not move and causal's tiles
    # slowed 7% with two V slots (benchmarks/NOTES.md, session 11)
    "ws_o_stage": _flag("LONGCTX_SPARSE_WS_O_STAGE"),
}

# shared memory a CTA may use on sm_90 (227 KiB), less what the barriers and the ticket ring take
_SMEM_BYTES = 232448 - 2048


# Diagnostic: an int64 tensor of shape (grid, 2, flash_sparse_ws.TRACE_ITEMS, 4), zeroed, makes the warp-specialised
# forward record the SM clock at each work item's start, Q ready, last tile done and output written
# (benchmarks/diag_items.py --trace). None: the kernel without those reads.
WS_TRACE: torch.Tensor | None = None


def _tiles_from_env(text: str) -> dict[str, tuple[int, int, int, int]]:
    """``"fwd=128,64,8,3;dkdv=32,128,8,3"`` -> {"fwd": (128, 64, 8, 3), "dkdv": (32, 128, 8, 3)}."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        kind, _, cfg = part.partition("=")
        vals = tuple(int(x) for x in cfg.split(","))
        if kind.strip() not in ("fwd", "dkdv", "dq") or len(vals) != 4:
            raise ValueError(
                f"LONGCTX_SPARSE_TILES entry {part!r}: expected kind=BLOCK_M,BLOCK_N,num_warps,num_stages with kind "
                "fwd, dkdv or dq, e.g. 'fwd=128,64,8,3;dkdv=32,128,8,3'"
            )
        out[kind.strip()] = vals
    return out


# For tuning sessions: kind ("fwd", "dkdv", "dq") -> (BLOCK_M, BLOCK_N, num_warps, num_stages) forced, no
# autotuning (also from ``LONGCTX_SPARSE_TILES="fwd=128,64,8,3;dkdv=32,128,8,3"``). Empty in normal use.
FORCE_CONFIG: dict[str, tuple[int, int, int, int]] = _tiles_from_env(os.environ.get("LONGCTX_SPARSE_TILES", ""))
# For tuning sessions: "fwd" -> (BLOCK_N, STAGES, PIPE), "bwd" -> (BLOCK_M, STAGES, EARLY_DV) of the warp-specialised
# kernels, instead of the dense kernels' tables. Empty in normal use.
WS_FORCE_CONFIG: dict[str, tuple[int, int, bool]] = {}
# Tensor descriptor loads also run in the Triton interpreter (not its TMA reduce); tests of the TMA variants set
# this to run them there. Off: under the interpreter the pointer path runs.
TMA_IN_INTERPRETER = False


_VARIANT_CONSTEXPRS = ("GRID_SWAP", "PREFETCH_IDX", "USE_TMA", "PIPE_QK", "REVERSE_M", "ATOMIC_DQ")


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
    # the variant flags are in the key: a tile that suits one variant may not fit another's shared memory
    key = ["HEAD_DIM", "MASK_KIND", "HAS_DOC", "HAS_GLOBAL", "SEQ_BUCKET", *_VARIANT_CONSTEXPRS]
    # with ATOMIC_DQ the dK/dV kernel adds into DQA: zeroed before every timed run and the real one
    reset = ["DQA"] if kind == "dkdv" else None
    return triton.autotune(cfgs, key=key, reset_to_zero=reset)(fn)


def _launch(kind: str, bd: int, mask_bs: int, grid_fn, args: list, kwargs: dict) -> None:
    if kind in FORCE_CONFIG:
        bm, bn, w, s = FORCE_CONFIG[kind]
        _kernel_fn(kind)[grid_fn(bm, bn)](*args, **kwargs, BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s)
        return
    kernel = _kernel(kind, bd, mask_bs)
    if _tf._autotune_enabled():
        kernel[lambda meta: grid_fn(meta["BLOCK_M"], meta["BLOCK_N"])](*args, **kwargs)
        return
    bm, bn, w, s = _tile_choices(kind, bd, mask_bs)[0]
    kernel[grid_fn(bm, bn)](*args, **kwargs, BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s)


def _grid(n_heads: int, n_tiles, swap: bool):
    """Grid function of (BLOCK_M, BLOCK_N): (heads, tiles), or (tiles, heads) with the tile index fastest."""
    if swap:
        return lambda bm_, bn_: (n_tiles(bm_, bn_), n_heads)
    return lambda bm_, bn_: (n_heads, n_tiles(bm_, bn_))


def _tma_ok(t: torch.Tensor, D: int, bd: int) -> bool:
    """Whether rows of t (B, H, S, D) can be read through tensor descriptors (see triton_flash._tma_ok)."""
    return runtime._tma_ok(t, D, bd, in_interpreter=TMA_IN_INTERPRETER)


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


def _ws_config(kind: str, n_heads: int, mask_bs: int, *tensors: torch.Tensor) -> tuple | None:
    """The warp-specialised kernel's config for these inputs ("fwd": the dense forward's `WS_CONFIG`, "bwd": the
    dense backward's `WS_BWD_CONFIG`), or None where the Triton kernels run: the variant switched off, a mask block
    that is not a multiple of the kernels' 128 rows, 2^31 work items or more (their int32 index), or inputs the
    Gluon kernels do not take (`triton_flash._ws_inputs_ok`: fp16/bf16, head dim 64 or 128, sm_90, TMA-loadable
    strides)."""
    n_items = n_heads * _cdiv(max(tensors[0].shape[2], tensors[1].shape[2]), 128)
    if not VARIANT["ws" if kind == "fwd" else "ws_bwd"] or mask_bs % 128 or n_items >= 2**31:
        return None
    if not _tf._ws_inputs_ok(*tensors):
        return None
    if kind in WS_FORCE_CONFIG:
        return WS_FORCE_CONFIG[kind]
    return (_tf.WS_CONFIG if kind == "fwd" else _tf.WS_BWD_CONFIG)[tensors[0].shape[3]]


def _ws_failed(kind: str, exc: Exception) -> None:
    """A Gluon kernel that does not compile with this Triton: warn once, use the Triton kernels from now."""
    if type(exc).__name__ != "CompilationError":
        raise exc
    VARIANT["ws" if kind == "fwd" else "ws_bwd"] = False
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
    computing the order is ~10 small kernels and a third of a short forward's host time, session 10). Keyed by
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


def _use_schedule(kw: dict, persistent: bool) -> bool:
    """Whether the warp-specialised kernels take `_schedule`'s order. By default the persistent kernels always do.
    One CTA per item (``LONGCTX_SPARSE_WS_PERSIST=0``) takes it for the analytic masks: those with document ids,
    whose items' work ranges from one block to a whole document, and every mask in interval form (MASK_KIND 3:
    packed documents, causal, windows). ``LONGCTX_SPARSE_WS_SCHED=1`` / ``0`` forces it always / never."""
    sched = VARIANT["ws_sched"]
    if sched != "auto":
        return bool(sched)
    return persistent or kw["MASK_KIND"] == 3 or (kw["MASK_KIND"] == 1 and bool(kw["HAS_DOC"]))


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _work_grid(n_items: int, device: torch.device) -> tuple[tuple[int], torch.Tensor | None, bool]:
    """(grid, ticket counter, persistent) of a warp-specialised launch over ``n_items`` work items: with
    VARIANT["ws_persist"], at most one CTA per SM (the kernels' shared memory allows no second) and a zeroed
    counter from which they take the items after their first; else one CTA per item."""
    if not VARIANT["ws_persist"]:
        return (n_items,), None, False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    return (min(n_items, _num_sms(idx)),), torch.zeros(1, dtype=torch.int32, device=device), True


def _o_stage(eligible: bool, D: int, block_n: int, stages: int, itemsize: int) -> tuple[bool, int]:
    """(output tiles of their own, V ring slots) of the warp-specialised forward: own output tiles where
    VARIANT["ws_o_stage"] and the launch is ``eligible`` (persistent, output through the copy engine), with as many
    V slots as K slots where shared memory allows and one fewer otherwise (D=128: 2 x 16 KiB of Q and 2 of output,
    3 K and 2 V slots of 32 KiB); else none and ``stages`` V slots."""
    if not (eligible and VARIANT["ws_o_stage"]):
        return False, stages
    q_bytes = 2 * 2 * 64 * D * itemsize  # Q and output tiles of both warpgroups, 64 rows each
    tile = block_n * D * itemsize
    for v_stages in (stages, stages - 1):
        if v_stages >= 2 and q_bytes + (stages + v_stages) * tile <= _SMEM_BYTES:
            return True, v_stages
    return False, stages


def _forward_ws(q, k, v, out, lse, scale: float, margs: list, mkw: dict, mask_bs: int, config) -> None:
    """Launch `flash_sparse_ws.sparse_fwd_ws_kernel` (conditions and config: `_ws_config`)."""
    from longctx.kernels.gluon import flash_sparse_ws as sws

    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    block_n, stages, pipe = config
    n_tiles = _cdiv(Sq, int(sws.CTA_ROWS))
    grid, cnt, persist = _work_grid(n_tiles * B * Hq, q.device)
    use_sched = _use_schedule(mkw, persist)
    sched = _schedule_cached(margs[0], margs[2], n_tiles, int(sws.CTA_ROWS), mask_bs, 1) if use_sched else lse
    o_tma = VARIANT["ws_o_tma"]
    o_stage, v_stages = _o_stage(persist and o_tma, D, block_n, stages, q.element_size())
    if WS_TRACE is not None and (WS_TRACE.dtype != torch.int64 or WS_TRACE.shape[:2] != (grid[0], 2)
                                 or WS_TRACE.shape[2:] != (int(sws.TRACE_ITEMS), 4)):  # fmt: skip
        raise ValueError(
            f"WS_TRACE must be int64 of shape ({grid[0]}, 2, {int(sws.TRACE_ITEMS)}, 4) for this launch (one row per "
            f"CTA), got {WS_TRACE.dtype} {tuple(WS_TRACE.shape)}"
        )
    sws.sparse_fwd_ws_kernel[grid](
        runtime._gluon_desc(q, int(sws.WG_ROWS)), runtime._gluon_desc(k, block_n), runtime._gluon_desc(v, block_n),
        runtime._gluon_desc(out, int(sws.WG_ROWS)) if o_tma else out, out, lse, *out.stride(), *margs, sched,
        lse if cnt is None else cnt, lse if WS_TRACE is None else WS_TRACE, n_tiles * B * Hq, n_tiles,
        USE_SCHED=use_sched, Hq=Hq, Sq=Sq, Sk=Sk, GROUP=Hq // Hkv, qk_scale=scale * _LOG2E,
        HEAD_DIM=D, BLOCK_D=D, MASK_BS=mask_bs, EVEN_SK=Sk % mask_bs == 0,
        BLOCK_N=block_n, STAGES=stages, PIPE=pipe, PERSIST=persist,
        EARLY_Q=VARIANT["ws_early_q"] and (o_stage or not o_tma), O_TMA=o_tma, O_STAGE=o_stage, V_STAGES=v_stages,
        TRACE=WS_TRACE is not None,
        CONSUMER_REGS=240, PRODUCER_REGS=24,
        num_warps=4, maxnreg=168, **mkw,
    )  # fmt: skip


def _backward_ws(q, k, v, do, delta, lse2, dk, dv, dqa, scale: float, targs: list, tkw: dict, mask_bs: int, config):
    """Launch `flash_sparse_ws.sparse_bwd_ws_kernel`: dK, dV into ``dk`` / ``dv``, scale * dS K added into ``dqa``
    (float32, zeroed, contiguous); lse2 / Delta with rows padded to 4 floats (`triton_flash.bwd_preprocess`)."""
    from longctx.kernels.gluon import flash_sparse_ws as sws

    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    block_m, stages, early_dv = config
    rows = int(sws.CTA_ROWS)
    n_tiles = _cdiv(Sk, rows)
    grid, cnt, persist = _work_grid(n_tiles * B * Hkv, q.device)
    use_sched = _use_schedule(tkw, persist)
    sched = _schedule_cached(targs[0], targs[2], n_tiles, rows, mask_bs, Hq // Hkv) if use_sched else lse2
    # dK / dV leave by the copy engine only in the persistent kernel with the bulk-reduced dQ and 64-row query
    # tiles (`flash_sparse_ws._bwd_item`); elsewhere the descriptor slots take unused placeholders
    dkdv_tma = persist and _tf.WS_BWD_DQ_TMA and block_m != rows
    desc_dk, desc_dv = [runtime._gluon_desc(t, int(sws.WG_ROWS)) for t in (dk, dv)] if dkdv_tma else [dk, dv]
    sws.sparse_bwd_ws_kernel[grid](
        runtime._gluon_desc(q, block_m), runtime._gluon_desc(k, rows), runtime._gluon_desc(v, rows),
        runtime._gluon_desc(do, block_m),
        runtime._gluon_rows_desc(lse2, block_m), runtime._gluon_rows_desc(delta, block_m),
        dk, dv, dqa, _tf._dqa_desc(dqa, block_m, D) if _tf.WS_BWD_DQ_TMA else dqa,
        desc_dk, desc_dv, *dk.stride(), *dv.stride(), *dqa.stride()[:3], *targs, sched, lse2 if cnt is None else cnt,
        n_tiles * B * Hkv, n_tiles, Hq=Hq, Hkv=Hkv, Sq=Sq, Sk=Sk, GROUP=Hq // Hkv, stride_lse=lse2.shape[2],
        qk_scale=scale * _LOG2E,
        sm_scale=scale, USE_SCHED=use_sched, BLOCK_D=D, MASK_BS=mask_bs,
        EVEN=Sq % mask_bs == 0 and Sk % mask_bs == 0, BLOCK_M=block_m, STAGES=stages, EARLY_DV=early_dv,
        CONSUMER_REGS=240, PRODUCER_REGS=24, DQ_TMA=_tf.WS_BWD_DQ_TMA, PERSIST=persist, num_warps=4, maxnreg=168,
        **tkw,
    )  # fmt: skip


def _forward_impl(q, k, v, scale: float, mt: tuple, meta: list) -> tuple[torch.Tensor, torch.Tensor]:
    _check(q, k, v, meta)
    from longctx import tuning as configs

    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    mask_bs = meta[0]
    out = torch.empty_like(q)
    lse = torch.empty((B, Hq, Sq), device=q.device, dtype=torch.float32)
    if out.numel() == 0:
        return out, lse
    bd = configs.block_d(D)
    margs, mkw = _mask_args(mt, meta, B, Hq, transposed=False)
    ws = _ws_config("fwd", B * Hq, mask_bs, q, k, v)
    if ws is not None:
        try:
            _forward_ws(q, k, v, out, lse, scale, margs, mkw, mask_bs, ws)
            return out, lse
        except Exception as exc:  # Gluon is experimental: another Triton may not compile the kernel
            _ws_failed("fwd", exc)
    # Sq or Sk below 16: no TMA (the dense launcher's ptxas crash at D=256; nothing to gain on such inputs)
    use_tma = VARIANT["tma"] and min(Sq, Sk) >= 16 and _tma_ok(k, D, bd) and _tma_ok(v, D, bd)
    if use_tma:
        runtime._set_tma_allocator()
    _launch(
        "fwd",
        bd,
        mask_bs,
        _grid(B * Hq, lambda bm_, bn_: _cdiv(Sq, bm_), VARIANT["grid_swap"]),
        [q, k, v, out, lse, *q.stride(), *k.stride(), *v.stride(), *out.stride(), *margs],
        dict(
            GRID_SWAP=VARIANT["grid_swap"],
            USE_TMA=use_tma,
            PIPE_QK=VARIANT["pipe_qk"],
            PREFETCH_IDX=VARIANT["prefetch_idx"],
            REVERSE_M=VARIANT["reverse_m"],
            Hq=Hq,
            Sq=Sq,
            Sk=Sk,
            GROUP=Hq // Hkv,
            qk_scale=float(scale) * _LOG2E,
            SEQ_BUCKET=_tf._seq_bucket(max(Sq, Sk)),
            HEAD_DIM=D,
            BLOCK_D=bd,
            MASK_BS=mask_bs,
            EVEN_SK=Sk % mask_bs == 0,
            DOT_PRECISION=runtime._dot_precision(q.dtype),
            **mkw,
        ),
    )
    return out, lse


def _backward_impl(do, q, k, v, out, lse, dlse, scale: float, mt: tuple, meta: list, deterministic: bool = False):
    _check(q, k, v, meta)
    from longctx import tuning as configs

    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    mask_bs = meta[0]
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if dq.numel() == 0 or dk.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    bd = configs.block_d(D)
    if runtime._interpret():
        runtime._patch_interpreter_for_numpy2()
    nondet = not (deterministic or _tf._deterministic_env())
    ws = _ws_config("bwd", B * Hkv, mask_bs, q, k, v, do) if nondet else None
    # (B, Hq, Sq) each; for the warp-specialised kernel each head's rows padded to 4 floats (TMA alignment)
    delta, lse2 = _tf.bwd_preprocess(out, do, lse, dlse, bd, _cdiv(Sq, 4) * 4 if ws is not None else None)
    if ws is not None:
        dqa = torch.zeros((B, Hq, Sq, D), device=q.device, dtype=torch.float32)
        targs, tkw = _mask_args(mt, meta, B, Hq, transposed=True)
        try:
            _backward_ws(q, k, v, do, delta, lse2, dk, dv, dqa, scale, targs, tkw, mask_bs, ws)
        except Exception as exc:
            _ws_failed("bwd", exc)
            delta, lse2 = _tf.bwd_preprocess(out, do, lse, dlse, bd)  # unpadded rows for the Triton kernels
        else:
            dq.copy_(dqa)  # the kernel applied the scale
            return dq, dk, dv
    swap = VARIANT["grid_swap"]
    common = dict(
        Sq=Sq,
        Sk=Sk,
        GROUP=Hq // Hkv,
        qk_scale=float(scale) * _LOG2E,
        sm_scale=float(scale),
        SEQ_BUCKET=_tf._seq_bucket(max(Sq, Sk)),
        HEAD_DIM=D,
        BLOCK_D=bd,
        MASK_BS=mask_bs,
        DOT_PRECISION=runtime._dot_precision(q.dtype),
        GRID_SWAP=swap,
        PREFETCH_IDX=VARIANT["prefetch_idx"],
    )
    # dQ by atomics inside the dK/dV kernel (a variant, off by default): 5 matmuls per tile pair instead of 7,
    # but not bitwise repeatable; at head dims above 128 the kernel would not fit shared memory.
    atomic = 0
    if VARIANT["atomic_dq"] in ("ptr", "tma") and nondet and bd <= 128:
        atomic = 2 if VARIANT["atomic_dq"] == "tma" and not runtime._interpret() and _tma_ok(q, D, bd) else 1
    dqa = torch.zeros((B, Hq, Sq, D), device=q.device, dtype=torch.float32) if atomic else dq  # (B, Hq, Sq, D)
    if atomic == 2:
        runtime._set_tma_allocator()
    targs, tkw = _mask_args(mt, meta, B, Hq, transposed=True)
    _launch(
        "dkdv",
        bd,
        mask_bs,
        _grid(B * Hkv, lambda bm_, bn_: _cdiv(Sk, bn_), swap),
        [q, k, v, do, lse2, delta, dk, dv, dqa, *q.stride(), *k.stride(), *v.stride(), *do.stride()]
        + [*dk.stride(), *dv.stride(), *dqa.stride()[:3], *targs],
        dict(Hq=Hq, Hkv=Hkv, ATOMIC_DQ=atomic, **common, **tkw),
    )
    if atomic:
        dq.copy_(dqa.mul_(scale))
        return dq, dk, dv
    use_tma = VARIANT["tma_dq"] and min(Sq, Sk) >= 16 and _tma_ok(k, D, bd) and _tma_ok(v, D, bd)
    if use_tma:
        runtime._set_tma_allocator()
    margs, mkw = _mask_args(mt, meta, B, Hq, transposed=False)
    _launch(
        "dq",
        bd,
        mask_bs,
        _grid(B * Hq, lambda bm_, bn_: _cdiv(Sq, bm_), swap),
        [q, k, v, do, lse2, delta, dq, *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dq.stride(), *margs],
        dict(Hq=Hq, EVEN_SK=Sk % mask_bs == 0, USE_TMA=use_tma, REVERSE_M=VARIANT["reverse_m"], **common, **mkw),
    )
    return dq, dk, dv


def sparse_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, block_mask: BlockMask
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-sparse forward: q (B, Hq, Sq, D), k/v (B, Hkv, Sk, D), any strides -> out (q's layout), lse (B, Hq, Sq)."""
    block_mask.check_compatible(q, k)
    return _forward_impl(q, k, v, float(scale), block_mask.kernel_tensors(), block_mask.kernel_meta())


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block-sparse backward: (dq, dk, dv) in the input dtypes and layouts. Deterministic (no atomics) unless
    the atomic-dQ variant is switched on (``LONGCTX_SPARSE_ATOMIC_DQ``) and ``deterministic`` is False."""
    block_mask.check_compatible(q, k)
    mt, meta = block_mask.kernel_tensors(), block_mask.kernel_meta()
    return _backward_impl(do, q, k, v, out, lse, dlse, float(scale), mt, meta, deterministic)
