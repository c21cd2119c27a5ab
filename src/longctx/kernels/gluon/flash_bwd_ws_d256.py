"""dK and dV at head dim 256 for Hopper, warp-specialised, in Gluon.

Why a kernel of its own: `flash_bwd_ws` gives each consumer warpgroup 64 key rows with their fp32 dK and dV in
registers, which at D=256 is 256 registers a thread, past the 240 a consumer gets; and K and V of its 128 key rows
alone would fill 128 KB of shared memory. The Triton path splits dV and dK into two launches instead, and both
recompute the scores. Here the two consumer warpgroups share the CTA's 64 key rows and split the head dim: warpgroup
w holds the dK and dV columns ``[128 w, 128 (w + 1))`` (128 registers), and the scores by query columns, so that
no product is computed twice:

- producer (a worker, 1 warp): K and V of the CTA once, then Q and dO of each query tile (64 rows) into a ring of
  ``STAGES`` slots.
- consumer w in {0, 1} (4 warps each; consumer 0 is the default partition), per query tile:

      S^T_w  = K Q_w^T          (64 keys x the tile's queries [32 w, 32 (w + 1)), over all 256 columns)
      dP^T_w = V dO_w^T
      P^T_w  = exp2(S^T_w * scale * log2(e) - lse2_w),   dS^T_w = P^T_w * (dP^T_w - Delta_w)
      P^T_w, dS^T_w (bf16) -> the exchange tiles' columns [32 w, 32 (w + 1)); both halves ready (mbarrier)
      dV_w += P^T dO[:, cols_w]     (the whole 64 x 64 P^T from shared memory)
      dK_w += dS^T Q[:, cols_w]

  The exchange tiles are double-buffered with "ready" (both halves written) and "free" (both products done)
  mbarriers, as `flash_bwd_ws`'s dS^T tile. Their shared layout swizzles 64 bytes, so each warpgroup's 32 columns
  are whole swizzle atoms.

dQ is not computed here: the launcher runs the Triton dQ kernel after it (`launchers.flash`), as the Triton path
does at D=256. lse2 (the forward's lse in base 2, +inf on rows that see nothing) and Delta come from
`flash_bwd.bwd_preprocess_kernel`, read with pointer loads (unpadded rows, as the dQ kernel reads them).

`sparse_bwd_dkdv_ws_d256_kernel` runs the same tile over the transposed block lists of a `BlockMask` (the block
walk and element masks of `flash_sparse.sparse_bwd_dkdv_kernel`, one CTA per 64 keys); the Triton block-sparse dQ
kernel runs after it (`launchers.sparse`).

Semantics are those of `flash_bwd.bwd_dkdv_kernel`: the band ``lo <= j - i <= hi``; the query tiles of the CTA in
masked / unmasked / masked runs (`flash_fwd._tile_ranges` read transposed); rows past Sq arrive as zeros from TMA and
get lse2 = +inf (P = 0); key rows past Sk arrive as zeros, are masked in every tile of the CTA that holds them, and
their dK / dV are not stored. Logit softcapping (SOFTCAP) as in `flash_bwd_ws`.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from longctx.kernels.gluon import flash_sparse_ws as sws
from longctx.kernels.gluon.flash_fwd_ws import _tanh, _tma_load, wgmma_layout
from longctx.kernels.triton.flash_fwd import _tile_ranges
from longctx.kernels.triton.flash_sparse import _visible

# fmt: off

BLOCK_N = gl.constexpr(64)  # key rows per CTA, shared by both consumers
BLOCK_M = gl.constexpr(64)  # query rows per tile: 32 per consumer
NUM_CONSUMERS = gl.constexpr(2)
EX_SLOTS = gl.constexpr(2)  # depth of the P^T / dS^T exchange


@gluon.jit
def _program(Hkv):
    """(batch, kv head, first key row) of this CTA; key tiles fastest (the resident CTAs share a head's Q / dO in
    L2, as `flash_bwd_ws._program`)."""
    pid_bh = gl.program_id(1)
    return pid_bh // Hkv, pid_bh % Hkv, gl.program_id(0) * BLOCK_N


@gluon.jit
def _query_ranges(start_n, Sq, Sk, lo, hi, HAS_LO: gl.constexpr, HAS_HI: gl.constexpr):
    """Query tiles that see the CTA's keys, as masked / unmasked / masked runs; the CTA holding the ragged end of Sk
    masks every tile (`flash_bwd_ws._query_ranges`)."""
    col_last = gl.minimum(start_n + BLOCK_N, Sk) - 1
    q_lo, full_lo, full_hi, q_end = _tile_ranges(start_n, col_last, Sq, -hi, -lo, HAS_HI, HAS_LO, BLOCK_M)
    if start_n + BLOCK_N > Sk:
        full_lo = q_end
        full_hi = q_end
    return q_lo, full_lo, full_hi, q_end


@gluon.jit
def _producer(desc_q, desc_k, desc_v, desc_do, q_smem, do_smem, k_smem, v_smem, kv_bar, q_ready, do_ready, q_empty,
              Sq, Sk, Hkv, GROUP, lo, hi, HAS_LO: gl.constexpr, HAS_HI: gl.constexpr, STAGES: gl.constexpr):
    """One warp: K and V of the CTA, then Q and dO of every query tile (per query head of the group), in the
    consumers' order, STAGES slots ahead."""
    off_b, off_kvh, start_n = _program(Hkv)
    _load_kv(desc_k, desc_v, k_smem, v_smem, kv_bar, off_b, off_kvh, start_n)
    q_lo, full_lo, full_hi, q_end = _query_ranges(start_n, Sq, Sk, lo, hi, HAS_LO, HAS_HI)
    i = 0
    for g in range(GROUP):
        off_h = off_kvh * GROUP + g
        for start_m in range(q_lo, q_end, BLOCK_M):
            _load_tile(desc_q, desc_do, q_smem, do_smem, q_ready, do_ready, q_empty, off_b, off_h, start_m, i, STAGES)
            i += 1  # noqa: SIM113 (Gluon loops have no enumerate)


@gluon.jit
def _load_kv(desc_k, desc_v, k_smem, v_smem, kv_bar, off_b, off_kvh, start_n):
    mbarrier.expect(kv_bar, desc_k.block_type.nbytes + desc_v.block_type.nbytes)
    _tma_load(desc_k, [off_b, off_kvh, start_n, 0], kv_bar, k_smem)
    _tma_load(desc_v, [off_b, off_kvh, start_n, 0], kv_bar, v_smem)


@gluon.jit
def _load_tile(desc_q, desc_do, q_smem, do_smem, q_ready, do_ready, q_empty, off_b, off_h, start_m, i,
               STAGES: gl.constexpr):
    """Q and dO of the ``i``-th query tile into its ring slot, once both consumers finished their products on the
    slot's previous tile."""
    s = i % STAGES
    ph = (i // STAGES) & 1
    mbarrier.wait(q_empty.index(s), ph ^ 1)
    mbarrier.expect(q_ready.index(s), desc_q.block_type.nbytes)
    _tma_load(desc_q, [off_b, off_h, start_m, 0], q_ready.index(s), q_smem.index(s))
    mbarrier.expect(do_ready.index(s), desc_do.block_type.nbytes)
    _tma_load(desc_do, [off_b, off_h, start_m, 0], do_ready.index(s), do_smem.index(s))


@gluon.jit
def _tile(dk, dv, i, k_all, v_all, q_smem, do_smem, p_smem, ds_smem, q_ready, do_ready, q_empty, ex_ready, ex_free,
          LSE2_bh, DELTA_bh, offs_n, start_m, keep, Sq, Sk, lo, hi, qk_scale, softcap_scale, WG: gl.constexpr,
          s_layout: gl.constexpr, MASKED: gl.constexpr, HAS_LO: gl.constexpr, HAS_HI: gl.constexpr,
          BLOCK_D: gl.constexpr, STAGES: gl.constexpr, SOFTCAP: gl.constexpr):
    """One query tile [start_m, start_m + 64): this warpgroup's 32 query columns of the scores, then its half of the
    head dim of dV and dK from the whole tile's P^T and dS^T. ``i`` counts tiles in the producer's order. MASKED:
    False (whole tiles inside the band), True (the band, Sq and Sk applied here) or 2 (``keep``, the caller's
    (64, 32) visibility tile: block-sparse masks)."""
    dtype: gl.constexpr = q_smem.dtype
    HALF_M: gl.constexpr = BLOCK_M // NUM_CONSUMERS
    HALF_D: gl.constexpr = BLOCK_D // NUM_CONSUMERS
    s = i % STAGES
    ph = (i // STAGES) & 1
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    offs_m = start_m + WG * HALF_M + gl.arange(0, HALF_M, layout=col_layout)
    row_ok = offs_m < Sq
    # (issued before the products are waited for: their latency hides behind the tensor cores)
    lse2 = gl.load(LSE2_bh + offs_m, mask=row_ok, other=float("inf"))
    delta = gl.load(DELTA_bh + offs_m, mask=row_ok, other=0.0)
    q_buf = q_smem.index(s).reshape([BLOCK_M, BLOCK_D])
    do_buf = do_smem.index(s).reshape([BLOCK_M, BLOCK_D])
    zero = gl.zeros([BLOCK_N, HALF_M], gl.float32, layout=s_layout)

    # -- S^T_w = K Q_w^T and dP^T_w = V dO_w^T, back to back; P^T_w while the second one runs --
    q_w = q_buf.slice(WG * HALF_M, HALF_M, dim=0)
    do_w = do_buf.slice(WG * HALF_M, HALF_M, dim=0)
    mbarrier.wait(q_ready.index(s), ph)
    sT = warpgroup_mma(k_all, q_w.permute((1, 0)), zero, use_acc=False, is_async=True)
    mbarrier.wait(do_ready.index(s), ph)
    dpT = warpgroup_mma(v_all, do_w.permute((1, 0)), zero, use_acc=False, is_async=True)
    sT, _, _ = warpgroup_mma_wait(1, deps=(sT, k_all, q_w))
    if SOFTCAP:
        tT = _tanh(sT * softcap_scale)
        sT = tT
    pT = gl.exp2(sT * qk_scale - lse2[None, :])
    if MASKED == 2:
        pT = gl.where(keep, pT, 0.0)
    elif MASKED:
        diff = offs_n[:, None] - offs_m[None, :]  # j - i
        keep = row_ok[None, :] & (offs_n[:, None] < Sk)
        if HAS_LO:
            keep = keep & (diff >= lo)
        if HAS_HI:
            keep = keep & (diff <= hi)
        pT = gl.where(keep, pT, 0.0)
    p16 = pT.to(dtype)
    if SOFTCAP:
        pT = pT * (1.0 - tT * tT)  # dS^T through the cap: d(softcap * tanh(x / softcap)) / dx = 1 - t^2
    dpT, _, _ = warpgroup_mma_wait(0, deps=(dpT, v_all, do_w))
    ds16 = (pT * (dpT - delta[None, :])).to(dtype)

    # -- both warpgroups' halves of P^T and dS^T into the exchange tiles --
    slot = i % EX_SLOTS
    eph = (i // EX_SLOTS) & 1
    mbarrier.wait(ex_free.index(slot), eph ^ 1)
    p_smem.index(slot).slice(WG * HALF_M, HALF_M, dim=1).store(p16)
    ds_smem.index(slot).slice(WG * HALF_M, HALF_M, dim=1).store(ds16)
    fence_async_shared()
    mbarrier.arrive(ex_ready.index(slot), count=1)
    mbarrier.wait(ex_ready.index(slot), eph)

    # -- dV_w += P^T dO[:, cols_w]; dK_w += dS^T Q[:, cols_w] --
    p_all = p_smem.index(slot)
    ds_all = ds_smem.index(slot)
    do_cols = do_buf.slice(WG * HALF_D, HALF_D, dim=1)
    q_cols = q_buf.slice(WG * HALF_D, HALF_D, dim=1)
    dv = warpgroup_mma(p_all, do_cols, dv, is_async=True)
    dk = warpgroup_mma(ds_all, q_cols, dk, is_async=True)
    dv, dk, _, _, _, _ = warpgroup_mma_wait(0, deps=(dv, dk, p_all, ds_all, do_cols, q_cols))
    mbarrier.arrive(ex_free.index(slot), count=1)
    mbarrier.arrive(q_empty.index(s), count=1)
    return dk, dv


@gluon.jit
def _run(dk, dv, i, k_all, v_all, q_smem, do_smem, p_smem, ds_smem, q_ready, do_ready, q_empty, ex_ready, ex_free,
         LSE2_bh, DELTA_bh, offs_n, start, end, Sq, Sk, lo, hi, qk_scale, softcap_scale, WG: gl.constexpr,
         s_layout: gl.constexpr, MASKED: gl.constexpr, HAS_LO: gl.constexpr, HAS_HI: gl.constexpr,
         BLOCK_D: gl.constexpr, STAGES: gl.constexpr, SOFTCAP: gl.constexpr):
    """Query tiles [start, end) of one query head."""
    for start_m in range(start, end, BLOCK_M):
        dk, dv = _tile(dk, dv, i, k_all, v_all, q_smem, do_smem, p_smem, ds_smem, q_ready, do_ready, q_empty,
                       ex_ready, ex_free, LSE2_bh, DELTA_bh, offs_n, start_m, 0, Sq, Sk, lo, hi, qk_scale,
                       softcap_scale, WG, s_layout, MASKED, HAS_LO, HAS_HI, BLOCK_D, STAGES, SOFTCAP)
        i += 1
    return dk, dv, i


@gluon.jit
def _consumer(q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, kv_bar, q_ready, do_ready, q_empty, ex_ready,
              ex_free, LSE2, DELTA, DK, DV,
              stride_dkb, stride_dkh, stride_dkn, stride_dkd,
              stride_dvb, stride_dvh, stride_dvn, stride_dvd,
              Hq, Hkv, Sq, Sk, GROUP, lo, hi, qk_scale, sm_scale, softcap_scale, WG: gl.constexpr,
              HAS_LO: gl.constexpr, HAS_HI: gl.constexpr, BLOCK_D: gl.constexpr, STAGES: gl.constexpr,
              SOFTCAP: gl.constexpr):
    """One warpgroup: columns [128 WG, 128 (WG + 1)) of dK and dV of the CTA's 64 keys, summed over the group's
    query heads."""
    HALF_D: gl.constexpr = BLOCK_D // NUM_CONSUMERS
    s_layout: gl.constexpr = wgmma_layout(BLOCK_M // NUM_CONSUMERS)
    acc_layout: gl.constexpr = wgmma_layout(HALF_D)
    off_b, off_kvh, start_n = _program(Hkv)
    offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
    k_all = k_smem.reshape([BLOCK_N, BLOCK_D])
    v_all = v_smem.reshape([BLOCK_N, BLOCK_D])
    dk = gl.zeros([BLOCK_N, HALF_D], gl.float32, layout=acc_layout)
    dv = gl.zeros([BLOCK_N, HALF_D], gl.float32, layout=acc_layout)
    q_lo, full_lo, full_hi, q_end = _query_ranges(start_n, Sq, Sk, lo, hi, HAS_LO, HAS_HI)
    mbarrier.wait(kv_bar, 0)
    i = 0
    for g in range(GROUP):
        off_h = off_kvh * GROUP + g
        row0 = (off_b * Hq + off_h).to(gl.int64) * Sq
        dk, dv, i = _run(dk, dv, i, k_all, v_all, q_smem, do_smem, p_smem, ds_smem, q_ready, do_ready, q_empty,
                         ex_ready, ex_free, LSE2 + row0, DELTA + row0, offs_n, q_lo, full_lo, Sq, Sk, lo, hi, qk_scale,
                         softcap_scale, WG, s_layout, True, HAS_LO, HAS_HI, BLOCK_D, STAGES, SOFTCAP)
        dk, dv, i = _run(dk, dv, i, k_all, v_all, q_smem, do_smem, p_smem, ds_smem, q_ready, do_ready, q_empty,
                         ex_ready, ex_free, LSE2 + row0, DELTA + row0, offs_n, full_lo, full_hi, Sq, Sk, lo, hi,
                         qk_scale, softcap_scale, WG, s_layout, False, HAS_LO, HAS_HI, BLOCK_D, STAGES, SOFTCAP)
        dk, dv, i = _run(dk, dv, i, k_all, v_all, q_smem, do_smem, p_smem, ds_smem, q_ready, do_ready, q_empty,
                         ex_ready, ex_free, LSE2 + row0, DELTA + row0, offs_n, full_hi, q_end, Sq, Sk, lo, hi, qk_scale,
                         softcap_scale, WG, s_layout, True, HAS_LO, HAS_HI, BLOCK_D, STAGES, SOFTCAP)

    _store_dkdv(dk, dv, DK, DV, stride_dkb, stride_dkh, stride_dkn, stride_dkd, stride_dvb, stride_dvh, stride_dvn,
                stride_dvd, off_b, off_kvh, start_n, Sk, sm_scale, WG, acc_layout, BLOCK_D)


@gluon.jit
def _store_dkdv(dk, dv, DK, DV, stride_dkb, stride_dkh, stride_dkn, stride_dkd, stride_dvb, stride_dvh, stride_dvn,
                stride_dvd, off_b, off_kvh, start_n, Sk, sm_scale, WG: gl.constexpr, acc_layout: gl.constexpr,
                BLOCK_D: gl.constexpr):
    """Epilogue of one warpgroup, its 128 columns: dK carries the softmax scale (s = scale * q.k), dV does not; key
    rows past Sk are not stored."""
    HALF_D: gl.constexpr = BLOCK_D // NUM_CONSUMERS
    rows = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_layout))
    cols = WG * HALF_D + gl.arange(0, HALF_D, layout=gl.SliceLayout(0, acc_layout))
    mask = (rows[:, None] < Sk) & (cols[None, :] < BLOCK_D)
    dk_ptrs = (DK + off_b.to(gl.int64) * stride_dkb + off_kvh.to(gl.int64) * stride_dkh
               + rows[:, None].to(gl.int64) * stride_dkn + cols[None, :] * stride_dkd)
    dv_ptrs = (DV + off_b.to(gl.int64) * stride_dvb + off_kvh.to(gl.int64) * stride_dvh
               + rows[:, None].to(gl.int64) * stride_dvn + cols[None, :] * stride_dvd)
    gl.store(dk_ptrs, (dk * sm_scale).to(DK.dtype.element_ty), mask=mask)
    gl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=mask)


@gluon.jit
def _shared(desc_q, desc_k, desc_v, desc_do, STAGES: gl.constexpr):
    """The CTA's shared memory: the ring of STAGES slots of Q and dO, K and V of the CTA's 64 keys, the EX_SLOTS-deep
    P^T / dS^T exchange tiles, and their mbarriers, initialised (224 KB at STAGES=2)."""
    dtype: gl.constexpr = desc_q.dtype
    q_smem = gl.allocate_shared_memory(dtype, [STAGES] + desc_q.block_type.shape, desc_q.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES] + desc_do.block_type.shape, desc_do.layout)
    k_smem = gl.allocate_shared_memory(dtype, desc_k.block_type.shape, desc_k.layout)
    v_smem = gl.allocate_shared_memory(dtype, desc_v.block_type.shape, desc_v.layout)
    # 64-byte swizzle: each consumer's 32 columns are whole swizzle atoms
    ex_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2)
    p_smem = gl.allocate_shared_memory(dtype, [EX_SLOTS, BLOCK_N, BLOCK_M], ex_layout)
    ds_smem = gl.allocate_shared_memory(dtype, [EX_SLOTS, BLOCK_N, BLOCK_M], ex_layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ex_ready = gl.allocate_shared_memory(gl.int64, [EX_SLOTS, 1], mbarrier.MBarrierLayout())
    ex_free = gl.allocate_shared_memory(gl.int64, [EX_SLOTS, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(s), count=1)
        mbarrier.init(do_ready.index(s), count=1)
        mbarrier.init(q_empty.index(s), count=NUM_CONSUMERS)
    for s in gl.static_range(EX_SLOTS):
        mbarrier.init(ex_ready.index(s), count=NUM_CONSUMERS)
        mbarrier.init(ex_free.index(s), count=NUM_CONSUMERS)
    return q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, kv_bar, q_ready, do_ready, q_empty, ex_ready, ex_free


@gluon.jit(do_not_specialize=["Sq", "Sk", "lo", "hi"])
def attn_bwd_dkdv_ws_d256_kernel(
    desc_q, desc_k, desc_v, desc_do, LSE2, DELTA, DK, DV,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    Hq, Hkv, Sq, Sk, GROUP, lo, hi, qk_scale, sm_scale, softcap_scale,
    BLOCK_D: gl.constexpr, HAS_LO: gl.constexpr, HAS_HI: gl.constexpr, STAGES: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, SOFTCAP: gl.constexpr = False,
):
    """Grid: (cdiv(Sk, 64), B * Hkv); launched with num_warps=4 (consumer 0) plus the workers' 4 + 1 warps.

    desc_q / desc_do: 4-D over (B, Hq, Sq, D), block (1, 1, 64, D); desc_k / desc_v over (B, Hkv, Sk, D), block
    (1, 1, 64, D); D = BLOCK_D = 256 (the head dim is not padded). LSE2 / DELTA: contiguous (B, Hq, Sq) float32 from
    the preprocessing kernel. DK / DV: (B, Hkv, Sk, D) with their own strides. SOFTCAP: the logit softcap
    (qk_scale and softcap_scale as the forward's, sm_scale unchanged)."""
    (q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, kv_bar, q_ready, do_ready, q_empty, ex_ready,
     ex_free) = _shared(desc_q, desc_k, desc_v, desc_do, STAGES)

    gl.warp_specialize([
        (_consumer, (q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, kv_bar, q_ready, do_ready, q_empty, ex_ready,
                     ex_free, LSE2, DELTA, DK, DV, stride_dkb, stride_dkh, stride_dkn, stride_dkd, stride_dvb,
                     stride_dvh, stride_dvn, stride_dvd, Hq, Hkv, Sq, Sk, GROUP, lo, hi, qk_scale, sm_scale,
                     softcap_scale, 0, HAS_LO, HAS_HI, BLOCK_D, STAGES, SOFTCAP)),
        (_consumer, (q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, kv_bar, q_ready, do_ready, q_empty, ex_ready,
                     ex_free, LSE2, DELTA, DK, DV, stride_dkb, stride_dkh, stride_dkn, stride_dkd, stride_dvb,
                     stride_dvh, stride_dvn, stride_dvd, Hq, Hkv, Sq, Sk, GROUP, lo, hi, qk_scale, sm_scale,
                     softcap_scale, 1, HAS_LO, HAS_HI, BLOCK_D, STAGES, SOFTCAP)),
        (_producer, (desc_q, desc_k, desc_v, desc_do, q_smem, do_smem, k_smem, v_smem, kv_bar, q_ready, do_ready,
                     q_empty, Sq, Sk, Hkv, GROUP, lo, hi, HAS_LO, HAS_HI, STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# -- block-sparse masks (`launchers.sparse`): the same tile over the transposed block lists of a `BlockMask` ------


@gluon.jit
def _sparse_producer(desc_q, desc_k, desc_v, desc_do, q_smem, do_smem, k_smem, v_smem, kv_bar, q_ready, do_ready,
                     q_empty, Q_NUM, Q_IDX, FULL_NUM, FULL_IDX, stride_nb, stride_nh, stride_ib, stride_ih, stride_ik,
                     Hkv, GROUP, MASK_BS: gl.constexpr, STAGES: gl.constexpr):
    """One warp: K and V of the CTA, then, per query head of the group, Q and dO of the query tiles of its kv
    block's full query blocks, then of its partial ones (the consumers' order)."""
    SUB: gl.constexpr = MASK_BS // BLOCK_M
    off_b, off_kvh, start_n = _program(Hkv)
    _load_kv(desc_k, desc_v, k_smem, v_smem, kv_bar, off_b, off_kvh, start_n)
    i = 0
    for g in range(GROUP):
        off_h = off_kvh * GROUP + g
        n_full, FULL_row, n_part, PART_row = sws._lists(Q_NUM, Q_IDX, FULL_NUM, FULL_IDX, stride_nb, stride_nh,
                                                        stride_ib, stride_ih, stride_ik, off_b, off_h,
                                                        start_n // MASK_BS)
        i = _load_list(desc_q, desc_do, q_smem, do_smem, q_ready, do_ready, q_empty, off_b, off_h, FULL_row,
                       n_full * SUB, i, MASK_BS, STAGES)
        i = _load_list(desc_q, desc_do, q_smem, do_smem, q_ready, do_ready, q_empty, off_b, off_h, PART_row,
                       n_part * SUB, i, MASK_BS, STAGES)


@gluon.jit
def _load_list(desc_q, desc_do, q_smem, do_smem, q_ready, do_ready, q_empty, off_b, off_h, IDX_row, n_tiles, i,
               MASK_BS: gl.constexpr, STAGES: gl.constexpr):
    """Q and dO of the query tiles of one block list (``n_tiles`` 64-row tiles of its blocks); returns ``i``."""
    SUB: gl.constexpr = MASK_BS // BLOCK_M
    for j in range(n_tiles):
        start_m = gl.load(IDX_row + j // SUB) * MASK_BS + (j % SUB) * BLOCK_M
        _load_tile(desc_q, desc_do, q_smem, do_smem, q_ready, do_ready, q_empty, off_b, off_h, start_m, i, STAGES)
        i += 1
    return i


@gluon.jit
def _sparse_run(dk, dv, i, k_all, v_all, q_smem, do_smem, p_smem, ds_smem, q_ready, do_ready, q_empty, ex_ready,
                ex_free, LSE2_bh, DELTA_bh, offs_n, kd, kp, IDX_row, n_tiles, kb, QDOC_b, QPOS_b, TILE_IDS_bh,
                stride_tq, TILES, Sq, Sk, lo, hi, kv_global, q_global, qk_scale, softcap_scale, WG: gl.constexpr,
                s_layout: gl.constexpr, MASKED: gl.constexpr, MASK_KIND: gl.constexpr, HAS_DOC: gl.constexpr,
                HAS_GLOBAL: gl.constexpr, MASK_BS: gl.constexpr, BLOCK_D: gl.constexpr, STAGES: gl.constexpr,
                SOFTCAP: gl.constexpr):
    """The listed query tiles of one query head; MASKED: the element mask of MASK_KIND and the bounds (MASK_KIND 0:
    the bounds only), else none."""
    SUB: gl.constexpr = MASK_BS // BLOCK_M
    HALF_M: gl.constexpr = BLOCK_M // NUM_CONSUMERS
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    for j in range(n_tiles):
        qb = gl.load(IDX_row + j // SUB)
        start_m = qb * MASK_BS + (j % SUB) * BLOCK_M
        if MASKED:
            rows = start_m + WG * HALF_M + gl.arange(0, HALF_M, layout=col_s)
            qd, qp = sws._tokens(QDOC_b, QPOS_b, rows, Sq, -1, MASK_KIND, HAS_DOC, True)
            keep = _visible(rows[None, :], offs_n[:, None], qd[None, :], kd[:, None], qp[None, :], kp[:, None], qb,
                            kb, TILE_IDS_bh, stride_tq, TILES, Sk, lo, hi, kv_global, q_global,
                            MASK_KIND, HAS_DOC, HAS_GLOBAL, MASK_BS)
            dk, dv = _tile(dk, dv, i, k_all, v_all, q_smem, do_smem, p_smem, ds_smem, q_ready, do_ready, q_empty,
                           ex_ready, ex_free, LSE2_bh, DELTA_bh, offs_n, start_m, keep, Sq, Sk, lo, hi, qk_scale,
                           softcap_scale, WG, s_layout, 2, False, False, BLOCK_D, STAGES, SOFTCAP)
        else:
            dk, dv = _tile(dk, dv, i, k_all, v_all, q_smem, do_smem, p_smem, ds_smem, q_ready, do_ready, q_empty,
                           ex_ready, ex_free, LSE2_bh, DELTA_bh, offs_n, start_m, 0, Sq, Sk, lo, hi, qk_scale,
                           softcap_scale, WG, s_layout, False, False, False, BLOCK_D, STAGES, SOFTCAP)
        i += 1
    return dk, dv, i


@gluon.jit
def _sparse_consumer(q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, kv_bar, q_ready, do_ready, q_empty, ex_ready,
                     ex_free, LSE2, DELTA, DK, DV,
                     stride_dkb, stride_dkh, stride_dkn, stride_dkd,
                     stride_dvb, stride_dvh, stride_dvn, stride_dvd,
                     Q_NUM, Q_IDX, FULL_NUM, FULL_IDX, stride_nb, stride_nh, stride_ib, stride_ih, stride_ik,
                     QDOC, KDOC, QPOS, KPOS, stride_qdoc, stride_kdoc, TILES, TILE_IDS, stride_tb, stride_th,
                     stride_tq, Hq, Hkv, Sq, Sk, GROUP, lo, hi, kv_global, q_global, qk_scale, sm_scale,
                     softcap_scale, WG: gl.constexpr, MASK_BS: gl.constexpr, MASK_KIND: gl.constexpr,
                     HAS_DOC: gl.constexpr, HAS_GLOBAL: gl.constexpr, EVEN: gl.constexpr, BLOCK_D: gl.constexpr,
                     STAGES: gl.constexpr, SOFTCAP: gl.constexpr):
    """One warpgroup: its 128 columns of dK and dV of the CTA's 64 keys, summed over the group's query heads."""
    HALF_D: gl.constexpr = BLOCK_D // NUM_CONSUMERS
    SUB: gl.constexpr = MASK_BS // BLOCK_M
    s_layout: gl.constexpr = wgmma_layout(BLOCK_M // NUM_CONSUMERS)
    acc_layout: gl.constexpr = wgmma_layout(HALF_D)
    off_b, off_kvh, start_n = _program(Hkv)
    kb = start_n // MASK_BS
    offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
    kd, kp = sws._tokens(KDOC + off_b.to(gl.int64) * stride_kdoc, KPOS + off_b.to(gl.int64) * stride_kdoc, offs_n,
                         Sk, -2, MASK_KIND, HAS_DOC, False)
    QDOC_b = QDOC + off_b.to(gl.int64) * stride_qdoc
    QPOS_b = QPOS + off_b.to(gl.int64) * stride_qdoc
    k_all = k_smem.reshape([BLOCK_N, BLOCK_D])
    v_all = v_smem.reshape([BLOCK_N, BLOCK_D])
    dk = gl.zeros([BLOCK_N, HALF_D], gl.float32, layout=acc_layout)
    dv = gl.zeros([BLOCK_N, HALF_D], gl.float32, layout=acc_layout)
    mbarrier.wait(kv_bar, 0)
    i = 0
    for g in range(GROUP):
        off_h = off_kvh * GROUP + g
        row0 = (off_b * Hq + off_h).to(gl.int64) * Sq
        TILE_IDS_bh = TILE_IDS + off_b.to(gl.int64) * stride_tb + off_h.to(gl.int64) * stride_th
        n_full, FULL_row, n_part, PART_row = sws._lists(Q_NUM, Q_IDX, FULL_NUM, FULL_IDX, stride_nb, stride_nh,
                                                        stride_ib, stride_ih, stride_ik, off_b, off_h, kb)
        # full blocks: no element mask where Sq and Sk end on block boundaries (else the bounds)
        dk, dv, i = _sparse_run(dk, dv, i, k_all, v_all, q_smem, do_smem, p_smem, ds_smem, q_ready, do_ready, q_empty,
                                ex_ready, ex_free, LSE2 + row0, DELTA + row0, offs_n, kd, kp, FULL_row, n_full * SUB,
                                kb, QDOC_b, QPOS_b, TILE_IDS_bh, stride_tq, TILES, Sq, Sk, lo, hi, kv_global, q_global,
                                qk_scale, softcap_scale, WG, s_layout, not EVEN, 0, False, False, MASK_BS, BLOCK_D,
                                STAGES, SOFTCAP)
        dk, dv, i = _sparse_run(dk, dv, i, k_all, v_all, q_smem, do_smem, p_smem, ds_smem, q_ready, do_ready, q_empty,
                                ex_ready, ex_free, LSE2 + row0, DELTA + row0, offs_n, kd, kp, PART_row, n_part * SUB,
                                kb, QDOC_b, QPOS_b, TILE_IDS_bh, stride_tq, TILES, Sq, Sk, lo, hi, kv_global, q_global,
                                qk_scale, softcap_scale, WG, s_layout, True, MASK_KIND, HAS_DOC, HAS_GLOBAL, MASK_BS,
                                BLOCK_D, STAGES, SOFTCAP)
    _store_dkdv(dk, dv, DK, DV, stride_dkb, stride_dkh, stride_dkn, stride_dkd, stride_dvb, stride_dvh, stride_dvn,
                stride_dvd, off_b, off_kvh, start_n, Sk, sm_scale, WG, acc_layout, BLOCK_D)


# the mask's lengths, bounds and table strides change with every packing: never specialised (`flash_sparse_ws`)
_SPARSE_RUNTIME_INTS = ["Sq", "Sk", "lo", "hi", "stride_nb", "stride_nh", "stride_ib", "stride_ih", "stride_ik",
                        "stride_tb", "stride_th", "stride_tq", "kv_global", "q_global"]


@gluon.jit(do_not_specialize=_SPARSE_RUNTIME_INTS)
def sparse_bwd_dkdv_ws_d256_kernel(
    desc_q, desc_k, desc_v, desc_do, LSE2, DELTA, DK, DV,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    Q_NUM, Q_IDX, FULL_NUM, FULL_IDX, stride_nb, stride_nh, stride_ib, stride_ih, stride_ik,
    QDOC, KDOC, QPOS, KPOS, stride_qdoc, stride_kdoc, TILES, TILE_IDS, stride_tb, stride_th, stride_tq,
    Hq, Hkv, Sq, Sk, GROUP, lo, hi, kv_global, q_global, qk_scale, sm_scale, softcap_scale,
    BLOCK_D: gl.constexpr, MASK_BS: gl.constexpr, MASK_KIND: gl.constexpr, HAS_DOC: gl.constexpr,
    HAS_GLOBAL: gl.constexpr, EVEN: gl.constexpr, STAGES: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, SOFTCAP: gl.constexpr = False,
):
    """Block-sparse dK / dV at D=256. Grid: (cdiv(Sk, 64), B * Hkv), as `attn_bwd_dkdv_ws_d256_kernel`; the mask's
    arguments (transposed lists, token tables, stored tiles) as `flash_sparse.sparse_bwd_dkdv_kernel`'s; MASK_BS a
    multiple of 64; EVEN: Sq and Sk multiples of MASK_BS (full blocks then need no bounds)."""
    (q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, kv_bar, q_ready, do_ready, q_empty, ex_ready,
     ex_free) = _shared(desc_q, desc_k, desc_v, desc_do, STAGES)
    gl.warp_specialize([
        (_sparse_consumer, (q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, kv_bar, q_ready, do_ready, q_empty,
                            ex_ready, ex_free, LSE2, DELTA, DK, DV, stride_dkb, stride_dkh, stride_dkn, stride_dkd,
                            stride_dvb, stride_dvh, stride_dvn, stride_dvd, Q_NUM, Q_IDX, FULL_NUM, FULL_IDX,
                            stride_nb, stride_nh, stride_ib, stride_ih, stride_ik, QDOC, KDOC, QPOS, KPOS,
                            stride_qdoc, stride_kdoc, TILES, TILE_IDS, stride_tb, stride_th, stride_tq, Hq, Hkv, Sq,
                            Sk, GROUP, lo, hi, kv_global, q_global, qk_scale, sm_scale, softcap_scale, 0, MASK_BS,
                            MASK_KIND, HAS_DOC, HAS_GLOBAL, EVEN, BLOCK_D, STAGES, SOFTCAP)),
        (_sparse_consumer, (q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, kv_bar, q_ready, do_ready, q_empty,
                            ex_ready, ex_free, LSE2, DELTA, DK, DV, stride_dkb, stride_dkh, stride_dkn, stride_dkd,
                            stride_dvb, stride_dvh, stride_dvn, stride_dvd, Q_NUM, Q_IDX, FULL_NUM, FULL_IDX,
                            stride_nb, stride_nh, stride_ib, stride_ih, stride_ik, QDOC, KDOC, QPOS, KPOS,
                            stride_qdoc, stride_kdoc, TILES, TILE_IDS, stride_tb, stride_th, stride_tq, Hq, Hkv, Sq,
                            Sk, GROUP, lo, hi, kv_global, q_global, qk_scale, sm_scale, softcap_scale, 1, MASK_BS,
                            MASK_KIND, HAS_DOC, HAS_GLOBAL, EVEN, BLOCK_D, STAGES, SOFTCAP)),
        (_sparse_producer, (desc_q, desc_k, desc_v, desc_do, q_smem, do_smem, k_smem, v_smem, kv_bar, q_ready,
                            do_ready, q_empty, Q_NUM, Q_IDX, FULL_NUM, FULL_IDX, stride_nb, stride_nh, stride_ib,
                            stride_ih, stride_ik, Hkv, GROUP, MASK_BS, STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
