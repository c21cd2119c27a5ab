"""FlashAttention backward (dK, dV and dQ) for Hopper, warp-specialised, in Gluon.

Why a second backward kernel: the same reason as `flash_fwd_ws`. The Triton dK/dV kernel keeps its warps on one
instruction stream with CTA-wide barriers around every TMA load, so the exp2 / elementwise phases of the two
warpgroups coincide and the tensor cores wait meanwhile. Here a producer warp streams the query-side tiles and the
two consumer warpgroups synchronise only through mbarriers.

One CTA owns ``2 * 64`` key rows of one kv head (their K and V stay in shared memory, their dK and dV in
registers) and walks the query tiles that see them, for every query head of the GQA group:

- producer (a worker, 1 warp): K and V once, then Q and dO of each query tile into a ring of ``STAGES`` slots.
- consumer w in {0, 1} (4 warps each; consumer 0 is the default partition): key rows
  ``[start_n + 64 w, start_n + 64 (w + 1))``. Per query tile (BLOCK_M rows):

      S^T  = K_w Q^T            (wgmma, both operands in shared memory)
      dP^T = V_w dO^T           (issued right behind it; runs while P^T is computed)
      P^T  = exp2(S^T * scale * log2(e) - lse2)       (lse2: the forward's lse in base 2)
      dV_w += P^T dO            (P^T from registers)
      dS^T = P^T * (dP^T - Delta)
      dK_w += dS^T Q            (dS^T from registers)
      dQ   += dS K              (dS^T of both warpgroups through shared memory; each warpgroup computes half of
                                 the tile's dQ and adds it to a float32 accumulator by the copy engine's bulk
                                 reduction from a shared tile, waited for one tile later: faster than float32
                                 atomics from registers, whose traffic through the LSU and L2 was the cost)

  The dS^T exchange goes through a double-buffered shared tile with "ready" (both halves written) and "free"
  (both dQ products done) mbarriers, so one warpgroup may run up to one query tile ahead of the other.

Semantics are those of `flash_bwd.bwd_dkdv_kernel` with ATOMIC_DQ: the band ``lo <= j - i <= hi``; the query
tiles of the CTA split into masked / unmasked / masked runs (`flash_fwd._tile_ranges` read transposed); Delta and
lse2 come from `flash_bwd.bwd_preprocess_kernel` (lse2 = +inf on rows that see nothing, so their P is 0); dQ is
added with the softmax scale already applied, dK gets it in the epilogue. Rows past Sq / Sk arrive as zeros from
TMA: past-Sq query rows are masked in the masked runs (the unmasked run holds whole tiles only), past-Sk key rows
have K = V = 0, so they add nothing to dQ, and their dK / dV are not stored.

Logit softcapping (SOFTCAP) as in `flash_bwd`: ``t = tanh(S^T * softcap_scale)`` from the raw scores (the forward's
`flash_fwd_ws._tanh`), ``P^T = exp2(t * qk_scale - lse2)`` (qk_scale = softcap * log2(e)), and dS^T multiplied by
the derivative of the cap, ``1 - t^2``, before dK and dQ (which carry the softmax scale as without SOFTCAP). With
SOFTCAP off (the default) the compiled code has no trace of it.
"""

from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from longctx.kernels.gluon.flash_fwd_ws import _tanh, wgmma_layout
from longctx.kernels.triton.flash_fwd import _tile_ranges

# fmt: off

_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared  # see flash_fwd_ws


@builtin
def _async_atomic_add(tensor_desc, coord, src, _semantic=None):
    """``tensor_desc[coord] += src`` (a shared-memory tile of the descriptor's block shape) by the copy engine's
    bulk reduction (cp.reduce.async.bulk.tensor .add), asynchronous: `tma.store_wait` before ``src`` is written
    again. Triton 3.9's Gluon has it as `tma.async_atomic_add`; 3.6 has only the builder's op."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


_tma_reduce_add = getattr(tma, "async_atomic_add", None) or _async_atomic_add

WG_ROWS = gl.constexpr(64)  # key rows per consumer warpgroup
NUM_CONSUMERS = gl.constexpr(2)
DS_SLOTS = gl.constexpr(2)  # depth of the dS^T exchange buffer


@gluon.jit
def _program(Hkv):
    """(batch, kv head, first key row) of this CTA. Grid (key tiles, B * Hkv), key tiles fastest: the CTAs that
    run at the same time share one or two heads, so their Q / dO stream and their dQ accumulator stay in L2 (with
    the heads fastest, each resident CTA walked a different head, far slower: docs/performance.md)."""
    pid_bh = gl.program_id(1)
    off_b = pid_bh // Hkv
    off_kvh = pid_bh % Hkv
    return off_b, off_kvh, gl.program_id(0) * (WG_ROWS * NUM_CONSUMERS)


@gluon.jit
def _query_ranges(start_n, Sq, Sk, lo, hi, HAS_LO: gl.constexpr, HAS_HI: gl.constexpr, BLOCK_M: gl.constexpr):
    """Query tiles that see the CTA's keys, as masked / unmasked / masked runs (the band lo <= j - i <= hi read
    as -hi <= i - j <= -lo). The CTA that holds the ragged end of Sk masks every tile: its keys past Sk arrive as
    zeros, and a zero key row still gets P = exp2(-lse2), which must not reach dQ as inf * 0."""
    col_last = gl.minimum(start_n + WG_ROWS * NUM_CONSUMERS, Sk) - 1
    q_lo, full_lo, full_hi, q_end = _tile_ranges(start_n, col_last, Sq, -hi, -lo, HAS_HI, HAS_LO, BLOCK_M)
    if start_n + WG_ROWS * NUM_CONSUMERS > Sk:
        full_lo = q_end
        full_hi = q_end
    return q_lo, full_lo, full_hi, q_end


@gluon.jit
def _producer(desc_q, desc_k, desc_v, desc_do, desc_lse2, desc_delta, q_smem, do_smem, k_smem, v_smem, lse2_smem,
              delta_smem, kv_bar, q_ready, do_ready, q_empty, Sq, Sk, Hq, Hkv, GROUP, lo, hi, stride_lse,
              HAS_LO: gl.constexpr, HAS_HI: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
    """One warp: K and V of the CTA, then Q with its lse2 and dO with its Delta, for every query tile (per query
    head of the group), in the consumers' order, STAGES slots ahead."""
    off_b, off_kvh, start_n = _program(Hkv)
    mbarrier.expect(kv_bar, desc_k.block_type.nbytes + desc_v.block_type.nbytes)
    _tma_load(desc_k, [off_b, off_kvh, start_n, 0], kv_bar, k_smem)
    _tma_load(desc_v, [off_b, off_kvh, start_n, 0], kv_bar, v_smem)
    q_lo, full_lo, full_hi, q_end = _query_ranges(start_n, Sq, Sk, lo, hi, HAS_LO, HAS_HI, BLOCK_M)
    i = 0
    for g in range(GROUP):
        off_h = off_kvh * GROUP + g
        row0 = (off_b * Hq + off_h) * stride_lse
        for start_m in range(q_lo, q_end, BLOCK_M):
            s = i % STAGES
            ph = (i // STAGES) & 1
            # Q and dO of a slot are released together, once both consumers finished their dK / dV products
            mbarrier.wait(q_empty.index(s), ph ^ 1)
            mbarrier.expect(q_ready.index(s), desc_q.block_type.nbytes + desc_lse2.block_type.nbytes)
            _tma_load(desc_q, [off_b, off_h, start_m, 0], q_ready.index(s), q_smem.index(s))
            _tma_load(desc_lse2, [row0 + start_m], q_ready.index(s), lse2_smem.index(s))
            mbarrier.expect(do_ready.index(s), desc_do.block_type.nbytes + desc_delta.block_type.nbytes)
            _tma_load(desc_do, [off_b, off_h, start_m, 0], do_ready.index(s), do_smem.index(s))
            _tma_load(desc_delta, [row0 + start_m], do_ready.index(s), delta_smem.index(s))
            i += 1  # noqa: SIM113 (Gluon loops have no enumerate)


@gluon.jit
def _tile(dk, dv, i, k_w, v_w, k_all, q_smem, do_smem, ds_smem, q_ready, do_ready, q_empty, ds_ready, ds_free,
          lse2_smem, delta_smem, DQA_bh, stride_dqam, offs_n, start_m, keep, Sq, Sk, lo, hi, qk_scale, sm_scale,
          desc_dqa, dq_smem, off_b, off_h, DQ_TMA: gl.constexpr, WG: gl.constexpr,
          s_layout: gl.constexpr, op_layout: gl.constexpr, dq_layout: gl.constexpr, MASKED: gl.constexpr,
          HAS_LO: gl.constexpr, HAS_HI: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_D: gl.constexpr,
          STAGES: gl.constexpr, DQ_SPLIT_M: gl.constexpr, EARLY_DV: gl.constexpr, softcap_scale=0.0,
          SOFTCAP: gl.constexpr = False):
    """One query tile [start_m, start_m + BLOCK_M) against this warpgroup's 64 keys; ``i`` counts query tiles
    in the producer's order (ring slot, barrier phases). MASKED: False (whole tiles inside the band), True (the
    band, Sq and Sk applied here) or 2 (``keep``, a (64, BLOCK_M) visibility tile of the caller: block-sparse
    masks, `flash_sparse_ws`). dQ leaves by the bulk reduction through ``desc_dqa``; DQA_bh, stride_dqam and
    DQ_TMA (which must be True) stay in the signature for `flash_sparse_ws`'s calls until it drops them. SOFTCAP:
    the logit softcap (the module docstring)."""
    gl.static_assert(DQ_TMA, "dQ is added by the bulk reduction only")
    dtype: gl.constexpr = q_smem.dtype
    s = i % STAGES
    ph = (i // STAGES) & 1
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    offs_m = start_m + gl.arange(0, BLOCK_M, layout=col_layout)
    q_buf = q_smem.index(s).reshape([BLOCK_M, BLOCK_D])
    do_buf = do_smem.index(s).reshape([BLOCK_M, BLOCK_D])
    zero = gl.zeros([WG_ROWS, BLOCK_M], gl.float32, layout=s_layout)

    # -- S^T = K Q^T and dP^T = V dO^T, back to back; P^T while the second one runs --
    mbarrier.wait(q_ready.index(s), ph)
    sT = warpgroup_mma(k_w, q_buf.permute((1, 0)), zero, use_acc=False, is_async=True)
    mbarrier.wait(do_ready.index(s), ph)
    dpT = warpgroup_mma(v_w, do_buf.permute((1, 0)), zero, use_acc=False, is_async=True)
    sT, _, _ = warpgroup_mma_wait(1, deps=(sT, k_w, q_buf))
    if SOFTCAP:
        # the capped scores from the raw ones: t = tanh(scale * q.k / softcap), kept for the chain rule
        tT = _tanh(sT * softcap_scale)
        sT = tT
    lse2 = lse2_smem.index(s).load(col_layout)
    pT = gl.exp2(sT * qk_scale - lse2[None, :])
    if MASKED == 2:
        pT = gl.where(keep, pT, 0.0)
    elif MASKED:
        diff = offs_n[:, None] - offs_m[None, :]  # j - i
        keep = (offs_m[None, :] < Sq) & (offs_n[:, None] < Sk)
        if HAS_LO:
            keep = keep & (diff >= lo)
        if HAS_HI:
            keep = keep & (diff <= hi)
        pT = gl.where(keep, pT, 0.0)
    if EARLY_DV:
        # dV's product is issued before dS^T is computed (more overlap); dS uses the bf16 P it already holds
        p_op = gl.convert_layout(pT.to(dtype), op_layout)
        dv = warpgroup_mma(p_op, do_buf, dv, is_async=True)
        dpT, _, _ = warpgroup_mma_wait(1, deps=(dpT, v_w, do_buf))
        delta = delta_smem.index(s).load(col_layout)
        p16 = gl.convert_layout(p_op, s_layout).to(gl.float32)
        dsT = p16 * (dpT - delta[None, :])
        if SOFTCAP:
            dsT = dsT * (1.0 - tT * tT)  # through the cap: d(softcap * tanh(x / softcap)) / dx = 1 - t^2
        dsT = dsT.to(dtype)
    else:
        # dS^T first (the float32 P and dP^T die here), then both products back to back
        if SOFTCAP:
            # P^T in bf16 for dV now, and P^T (1 - t^2) for dS^T (through the cap): t dies before dP^T arrives
            p_op = gl.convert_layout(pT.to(dtype), op_layout)
            pT = pT * (1.0 - tT * tT)
        dpT, _ = warpgroup_mma_wait(0, deps=(dpT, v_w))
        delta = delta_smem.index(s).load(col_layout)
        dsT = (pT * (dpT - delta[None, :])).to(dtype)
        if not SOFTCAP:
            p_op = gl.convert_layout(pT.to(dtype), op_layout)
        dv = warpgroup_mma(p_op, do_buf, dv, is_async=True)
    # -- dV += P^T dO (above); dK += dS^T Q --
    ds_op = gl.convert_layout(dsT, op_layout)
    dk = warpgroup_mma(ds_op, q_buf, dk, is_async=True)
    # -- this warpgroup's half of dS^T into the exchange tile --
    slot = i % DS_SLOTS
    dph = (i // DS_SLOTS) & 1
    mbarrier.wait(ds_free.index(slot), dph ^ 1)
    ds_smem.index(slot).slice(WG * WG_ROWS, WG_ROWS, dim=0).store(dsT)
    fence_async_shared()
    mbarrier.arrive(ds_ready.index(slot), count=1)
    dv, dk, _, _, _, _ = warpgroup_mma_wait(0, deps=(dv, dk, p_op, ds_op, q_buf, do_buf))
    mbarrier.arrive(q_empty.index(s), count=1)

    # -- dQ = dS K: this warpgroup's half (of the rows, or of the head dim) --
    mbarrier.wait(ds_ready.index(slot), dph)
    ds_all = ds_smem.index(slot).permute((1, 0))  # (BLOCK_M, 128): dS of the tile against the CTA's keys
    if DQ_SPLIT_M:
        a = ds_all.slice(WG * WG_ROWS, WG_ROWS, dim=0)
        b = k_all
        dq_m: gl.constexpr = WG_ROWS
        dq_n: gl.constexpr = BLOCK_D
        row0 = start_m + WG * WG_ROWS
        col0 = 0
    else:
        a = ds_all
        b = k_all.slice(WG * (BLOCK_D // 2), BLOCK_D // 2, dim=1)
        dq_m: gl.constexpr = BLOCK_M
        dq_n: gl.constexpr = BLOCK_D // 2
        row0 = start_m
        col0 = WG * (BLOCK_D // 2)
    dq = warpgroup_mma(a, b, gl.zeros([dq_m, dq_n], gl.float32, layout=dq_layout), use_acc=False, is_async=True)
    dq, _, _ = warpgroup_mma_wait(0, deps=(dq, a, b))
    mbarrier.arrive(ds_free.index(slot), count=1)
    # registers -> this warpgroup's shared tile -> the copy engine's bulk reduction; the copy is waited for one tile
    # later, just before the tile is written again, so the consumer never waits for it (rows past Sq are clipped by
    # the descriptor)
    tma.store_wait(0)
    dq_smem.reshape([dq_m, dq_n]).store(dq * sm_scale)
    fence_async_shared()
    _tma_reduce_add(desc_dqa, [off_b, off_h, row0, col0], dq_smem)
    return dk, dv


@gluon.jit
def _run(dk, dv, i, k_w, v_w, k_all, q_smem, do_smem, ds_smem, q_ready, do_ready, q_empty, ds_ready, ds_free,
         lse2_smem, delta_smem, DQA_bh, stride_dqam, offs_n, start, end, Sq, Sk, lo, hi, qk_scale, sm_scale,
         desc_dqa, dq_smem, off_b, off_h, WG: gl.constexpr, s_layout: gl.constexpr,
         op_layout: gl.constexpr, dq_layout: gl.constexpr, MASKED: gl.constexpr, HAS_LO: gl.constexpr,
         HAS_HI: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_D: gl.constexpr, STAGES: gl.constexpr,
         DQ_SPLIT_M: gl.constexpr, EARLY_DV: gl.constexpr, softcap_scale=0.0, SOFTCAP: gl.constexpr = False):
    """Query tiles [start, end) of one query head."""
    for start_m in range(start, end, BLOCK_M):
        dk, dv = _tile(dk, dv, i, k_w, v_w, k_all, q_smem, do_smem, ds_smem, q_ready, do_ready, q_empty, ds_ready,
                       ds_free, lse2_smem, delta_smem, DQA_bh, stride_dqam, offs_n, start_m, 0, Sq, Sk, lo, hi,
                       qk_scale, sm_scale, desc_dqa, dq_smem, off_b, off_h, True, WG, s_layout, op_layout, dq_layout,
                       MASKED, HAS_LO, HAS_HI, BLOCK_M, BLOCK_D, STAGES, DQ_SPLIT_M, EARLY_DV, softcap_scale, SOFTCAP)
        i += 1
    return dk, dv, i


@gluon.jit
def _consumer(q_smem, do_smem, k_smem, v_smem, lse2_smem, delta_smem, ds_smem, kv_bar, q_ready, do_ready, q_empty,
              ds_ready, ds_free, DK, DV, DQA, desc_dqa, dq_smem,
              stride_dkb, stride_dkh, stride_dkn, stride_dkd,
              stride_dvb, stride_dvh, stride_dvn, stride_dvd,
              stride_dqab, stride_dqah, stride_dqam,
              Hq, Hkv, Sq, Sk, GROUP, lo, hi, qk_scale, sm_scale, softcap_scale, WG: gl.constexpr,
              HAS_LO: gl.constexpr, HAS_HI: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_D: gl.constexpr,
              STAGES: gl.constexpr, DQ_SPLIT_M: gl.constexpr, EARLY_DV: gl.constexpr, SOFTCAP: gl.constexpr):
    """One warpgroup: dK and dV of 64 keys, summed over the group's query heads; its share of dQ."""
    s_layout: gl.constexpr = wgmma_layout(BLOCK_M)
    acc_layout: gl.constexpr = wgmma_layout(BLOCK_D)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    if DQ_SPLIT_M:
        dq_layout: gl.constexpr = wgmma_layout(BLOCK_D)
    else:
        dq_layout: gl.constexpr = wgmma_layout(BLOCK_D // 2)

    off_b, off_kvh, start_n = _program(Hkv)
    my_n = start_n + WG * WG_ROWS
    offs_n = my_n + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, s_layout))
    k_all = k_smem.reshape([WG_ROWS * NUM_CONSUMERS, BLOCK_D])
    v_all = v_smem.reshape([WG_ROWS * NUM_CONSUMERS, BLOCK_D])
    k_w = k_all.slice(WG * WG_ROWS, WG_ROWS, dim=0)
    v_w = v_all.slice(WG * WG_ROWS, WG_ROWS, dim=0)
    dk = gl.zeros([WG_ROWS, BLOCK_D], gl.float32, layout=acc_layout)
    dv = gl.zeros([WG_ROWS, BLOCK_D], gl.float32, layout=acc_layout)
    q_lo, full_lo, full_hi, q_end = _query_ranges(start_n, Sq, Sk, lo, hi, HAS_LO, HAS_HI, BLOCK_M)
    mbarrier.wait(kv_bar, 0)
    i = 0
    for g in range(GROUP):
        off_h = off_kvh * GROUP + g
        DQA_bh = DQA + off_b.to(gl.int64) * stride_dqab + off_h.to(gl.int64) * stride_dqah
        dk, dv, i = _run(dk, dv, i, k_w, v_w, k_all, q_smem, do_smem, ds_smem, q_ready, do_ready, q_empty, ds_ready,
                         ds_free, lse2_smem, delta_smem, DQA_bh, stride_dqam, offs_n, q_lo, full_lo, Sq, Sk, lo, hi,
                         qk_scale, sm_scale, desc_dqa, dq_smem.index(WG), off_b, off_h, WG, s_layout, op_layout,
                         dq_layout, True, HAS_LO, HAS_HI, BLOCK_M, BLOCK_D, STAGES, DQ_SPLIT_M, EARLY_DV,
                         softcap_scale, SOFTCAP)
        dk, dv, i = _run(dk, dv, i, k_w, v_w, k_all, q_smem, do_smem, ds_smem, q_ready, do_ready, q_empty, ds_ready,
                         ds_free, lse2_smem, delta_smem, DQA_bh, stride_dqam, offs_n, full_lo, full_hi, Sq, Sk, lo, hi,
                         qk_scale, sm_scale, desc_dqa, dq_smem.index(WG), off_b, off_h, WG, s_layout, op_layout,
                         dq_layout, False, HAS_LO, HAS_HI, BLOCK_M, BLOCK_D, STAGES, DQ_SPLIT_M, EARLY_DV,
                         softcap_scale, SOFTCAP)
        dk, dv, i = _run(dk, dv, i, k_w, v_w, k_all, q_smem, do_smem, ds_smem, q_ready, do_ready, q_empty, ds_ready,
                         ds_free, lse2_smem, delta_smem, DQA_bh, stride_dqam, offs_n, full_hi, q_end, Sq, Sk, lo, hi,
                         qk_scale, sm_scale, desc_dqa, dq_smem.index(WG), off_b, off_h, WG, s_layout, op_layout,
                         dq_layout, True, HAS_LO, HAS_HI, BLOCK_M, BLOCK_D, STAGES, DQ_SPLIT_M, EARLY_DV,
                         softcap_scale, SOFTCAP)

    tma.store_wait(0)  # the last reduction has read its shared tile
    _store_dkdv(dk, dv, DK, DV, stride_dkb, stride_dkh, stride_dkn, stride_dkd, stride_dvb, stride_dvh, stride_dvn,
                stride_dvd, off_b, off_kvh, my_n, Sk, sm_scale, acc_layout, BLOCK_D)


@gluon.jit
def _store_dkdv(dk, dv, DK, DV, stride_dkb, stride_dkh, stride_dkn, stride_dkd, stride_dvb, stride_dvh, stride_dvn,
                stride_dvd, off_b, off_kvh, my_n, Sk, sm_scale, acc_layout: gl.constexpr, BLOCK_D: gl.constexpr):
    """Epilogue of one warpgroup: dK carries the softmax scale (s = scale * q.k), dV does not; key rows past Sk
    are not stored."""
    rows = my_n + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, acc_layout))
    cols = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, acc_layout))
    mask = (rows[:, None] < Sk) & (cols[None, :] < BLOCK_D)
    dk_ptrs = (DK + off_b.to(gl.int64) * stride_dkb + off_kvh.to(gl.int64) * stride_dkh
               + rows[:, None].to(gl.int64) * stride_dkn + cols[None, :] * stride_dkd)
    dv_ptrs = (DV + off_b.to(gl.int64) * stride_dvb + off_kvh.to(gl.int64) * stride_dvh
               + rows[:, None].to(gl.int64) * stride_dvn + cols[None, :] * stride_dvd)
    gl.store(dk_ptrs, (dk * sm_scale).to(DK.dtype.element_ty), mask=mask)
    gl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=mask)


@gluon.jit
def _shared(desc_q, desc_k, desc_v, desc_do, desc_lse2, desc_delta, desc_dqa, BLOCK_M: gl.constexpr,
            STAGES: gl.constexpr, DQ_TMA: gl.constexpr):
    """The CTA's shared memory: the ring of STAGES slots of Q / lse2 and dO / Delta, K and V of the CTA's 128 keys,
    the DS_SLOTS-deep dS^T exchange tile, and their mbarriers, initialised; each consumer's float32 dQ tile on its
    way to the bulk reduction. (DQ_TMA, which must be True, stays in the signature for `flash_sparse_ws`'s calls.)"""
    gl.static_assert(DQ_TMA, "dQ is added by the bulk reduction only")
    dtype: gl.constexpr = desc_q.dtype
    BLOCK_N: gl.constexpr = WG_ROWS * NUM_CONSUMERS
    q_smem = gl.allocate_shared_memory(dtype, [STAGES] + desc_q.block_type.shape, desc_q.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES] + desc_do.block_type.shape, desc_do.layout)
    k_smem = gl.allocate_shared_memory(dtype, desc_k.block_type.shape, desc_k.layout)
    v_smem = gl.allocate_shared_memory(dtype, desc_v.block_type.shape, desc_v.layout)
    lse2_smem = gl.allocate_shared_memory(gl.float32, [STAGES] + desc_lse2.block_type.shape, desc_lse2.layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES] + desc_delta.block_type.shape, desc_delta.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
    ds_smem = gl.allocate_shared_memory(dtype, [DS_SLOTS, BLOCK_N, BLOCK_M], ds_layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [DS_SLOTS, 1], mbarrier.MBarrierLayout())
    ds_free = gl.allocate_shared_memory(gl.int64, [DS_SLOTS, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(s), count=1)
        mbarrier.init(do_ready.index(s), count=1)
        mbarrier.init(q_empty.index(s), count=NUM_CONSUMERS)
    for s in gl.static_range(DS_SLOTS):
        mbarrier.init(ds_ready.index(s), count=NUM_CONSUMERS)
        mbarrier.init(ds_free.index(s), count=NUM_CONSUMERS)
    dq_smem = gl.allocate_shared_memory(gl.float32, [NUM_CONSUMERS] + desc_dqa.block_type.shape, desc_dqa.layout)
    return (q_smem, do_smem, k_smem, v_smem, lse2_smem, delta_smem, ds_smem, kv_bar, q_ready, do_ready, q_empty,
            ds_ready, ds_free, dq_smem)


@gluon.jit(do_not_specialize=["Sq", "Sk", "lo", "hi", "stride_lse"])
def attn_bwd_ws_kernel(
    desc_q, desc_k, desc_v, desc_do, desc_lse2, desc_delta, DK, DV, DQA, desc_dqa,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    stride_dqab, stride_dqah, stride_dqam,
    Hq, Hkv, Sq, Sk, GROUP, lo, hi, stride_lse, qk_scale, sm_scale, softcap_scale,
    BLOCK_D: gl.constexpr, HAS_LO: gl.constexpr, HAS_HI: gl.constexpr,
    BLOCK_M: gl.constexpr, STAGES: gl.constexpr, EARLY_DV: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, SOFTCAP: gl.constexpr = False,
):
    """Grid: (cdiv(Sk, 128), B * Hkv); launched with num_warps=4 (consumer 0) plus the workers' 4 + 1 warps.

    desc_q / desc_do: 4-D over (B, Hq, Sq, D), block (1, 1, BLOCK_M, D); desc_k / desc_v over (B, Hkv, Sk, D),
    block (1, 1, 128, D). desc_lse2 / desc_delta: 1-D over the (B, Hq, stride_lse) float32 lse2 and Delta of
    the preprocessing kernel, block (BLOCK_M,); stride_lse is Sq rounded up to a multiple of 4 (a TMA box must
    start 16-byte aligned: Sq = 129 failed with an illegal instruction), the padding zeros. A tile's rows past
    Sq read padding or the next head's values, always finite; only masked runs hold such rows, and the mask
    zeroes their P. DQA is a
    (B, Hq, Sq, D) float32 accumulator, zeroed, unit stride on D (it receives scale * dS K) through desc_dqa, its
    4-D TMA descriptor with block (1, 1, BLOCK_M, D / 2) (or (1, 1, 64, D) when BLOCK_M is 128). The head dim is not padded: BLOCK_D is the head dim (64 or 128).
    SOFTCAP: the logit softcap (module docstring; qk_scale and softcap_scale as the forward's, sm_scale unchanged).
    """
    BLOCK_N: gl.constexpr = WG_ROWS * NUM_CONSUMERS
    # dQ split between the warpgroups by rows when the query tile has 128 of them, else by head-dim halves
    DQ_SPLIT_M: gl.constexpr = BLOCK_M == BLOCK_N
    (q_smem, do_smem, k_smem, v_smem, lse2_smem, delta_smem, ds_smem, kv_bar, q_ready, do_ready, q_empty, ds_ready,
     ds_free, dq_smem) = _shared(desc_q, desc_k, desc_v, desc_do, desc_lse2, desc_delta, desc_dqa, BLOCK_M, STAGES,
                                 True)

    gl.warp_specialize([
        (_consumer, (q_smem, do_smem, k_smem, v_smem, lse2_smem, delta_smem, ds_smem, kv_bar, q_ready, do_ready,
                     q_empty, ds_ready, ds_free, DK, DV, DQA, desc_dqa, dq_smem, stride_dkb, stride_dkh, stride_dkn,
                     stride_dkd, stride_dvb, stride_dvh, stride_dvn, stride_dvd, stride_dqab, stride_dqah, stride_dqam,
                     Hq, Hkv, Sq, Sk, GROUP, lo, hi, qk_scale, sm_scale, softcap_scale, 0, HAS_LO, HAS_HI, BLOCK_M,
                     BLOCK_D, STAGES, DQ_SPLIT_M, EARLY_DV, SOFTCAP)),
        (_consumer, (q_smem, do_smem, k_smem, v_smem, lse2_smem, delta_smem, ds_smem, kv_bar, q_ready, do_ready,
                     q_empty, ds_ready, ds_free, DK, DV, DQA, desc_dqa, dq_smem, stride_dkb, stride_dkh, stride_dkn,
                     stride_dkd, stride_dvb, stride_dvh, stride_dvn, stride_dvd, stride_dqab, stride_dqah, stride_dqam,
                     Hq, Hkv, Sq, Sk, GROUP, lo, hi, qk_scale, sm_scale, softcap_scale, 1, HAS_LO, HAS_HI, BLOCK_M,
                     BLOCK_D, STAGES, DQ_SPLIT_M, EARLY_DV, SOFTCAP)),
        (_producer, (desc_q, desc_k, desc_v, desc_do, desc_lse2, desc_delta, q_smem, do_smem, k_smem, v_smem,
                     lse2_smem, delta_smem, kv_bar, q_ready, do_ready, q_empty, Sq, Sk, Hq, Hkv, GROUP, lo, hi,
                     stride_lse, HAS_LO, HAS_HI, BLOCK_M, STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
