"""FlashAttention-2 backward in Triton: a preprocessing kernel, then dK/dV (+ dQ) and, when deterministic, dQ.

With ``s2 = (q . k) * scale * log2(e)`` and ``lse2 = lse * log2(e)`` (base 2), the probabilities are
recomputed as ``p = exp2(s2 - lse2)``; then

    dV = P^T dO        dP = dO V^T        dS = P * (dP - Delta)        dQ = scale dS K        dK = scale dS^T Q

with ``Delta = rowsum(dO * O)``.

Logit softcapping (SOFTCAP): the scores are ``softcap * tanh(x / softcap)`` of x = scale * q.k. The kernels
recompute ``t = tanh(q.k * softcap_scale)`` (softcap_scale = scale / softcap) from the raw q.k, take the
probabilities from the capped scores (``p = exp2(t * qk_scale - lse2)``, qk_scale = softcap * log2(e)), and
multiply dS by the derivative of the cap, ``1 - t^2``, before dQ and dK (which carry the softmax scale as
without SOFTCAP). With SOFTCAP off (the default) the compiled code has no trace of it.

- `bwd_preprocess_kernel` computes Delta and lse2 once per query row. Rows that see no key (lse = -inf)
  get lse2 = +inf, so ``exp2(s2 - lse2) = 0`` there and their gradients vanish without a branch.
- `bwd_dkdv_kernel`: one program per kv tile of one kv head; it loops over the GROUP query heads that share
  the kv head (GQA/MQA reduced on chip, never through per-head copies in memory) and over the query tiles
  the band lets see the kv tile, split like the forward into masked / unmasked / masked runs. With
  ATOMIC_DQ (the fast path) it also adds dS K into a float32 dQ accumulator with atomics: 5 matmuls per tile
  pair, but the order of the additions varies from run to run.
  WANT_DK / WANT_DV (both on by default) keep only one of the two products: at D=256 the fp32 dK and dV of one kv
  tile together outgrow the registers (`tuning.split_dkdv`), so the launcher runs the kernel twice, once for dV
  (2 matmuls per tile pair) and once for dK (3), then the dQ kernel.
- `bwd_dq_kernel` (the deterministic path): one program per query tile, looping over the kv tiles (same
  runs as the forward); it recomputes P and dP (7 matmuls in all) but writes each dQ element once, so the
  whole backward is bitwise repeatable.
"""

import triton
import triton.language as tl

from longctx.kernels.triton.flash_fwd import _tanh, _tile_ranges

# fmt: off


@triton.jit(do_not_specialize=["Sq", "stride_row"])
def bwd_preprocess_kernel(
    O, DO, LSE, DLSE, DELTA, LSE2,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_dob, stride_doh, stride_dom, stride_dod,
    Hq, Sq, stride_row,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, HAS_DLSE: tl.constexpr,
):
    """Grid: (cdiv(Sq, BLOCK_M), B * Hq). LSE and DLSE are (B, Hq, Sq) float32, contiguous; DELTA and LSE2
    (B, Hq, stride_row) with stride_row >= Sq (the warp-specialised backward loads them by TMA, which needs each
    head's rows 16-byte aligned).

    With a gradient for the lse itself (d lse / d s = P), dS = P * (dP - Delta + dlse): the kernel folds it
    into Delta, so the main kernels do not change.
    """
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = pid_bh // Hq
    off_h = pid_bh % Hq
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < Sq
    mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    o = tl.load(O + off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh
                + offs_m[:, None].to(tl.int64) * stride_om + offs_d[None, :] * stride_od, mask=mask, other=0.0)
    do = tl.load(DO + off_b.to(tl.int64) * stride_dob + off_h.to(tl.int64) * stride_doh
                 + offs_m[:, None].to(tl.int64) * stride_dom + offs_d[None, :] * stride_dod, mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    row = pid_bh.to(tl.int64) * Sq + offs_m
    if HAS_DLSE:
        delta = delta - tl.load(DLSE + row, mask=row_ok, other=0.0)
    lse = tl.load(LSE + row, mask=row_ok, other=float("-inf"))
    row = pid_bh.to(tl.int64) * stride_row + offs_m
    # base 2 for the exp2 of the main kernels; +inf on rows that see nothing so that p = exp2(s2 - lse2) = 0
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    tl.store(DELTA + row, delta, mask=row_ok)
    tl.store(LSE2 + row, lse2, mask=row_ok)


@triton.jit
def _dkdv_inner(
    dk, dv, k, v,
    Q_bh, DO_bh, LSE2_bh, DELTA_bh, DQA_bh, desc_dqa,
    stride_qm, stride_qd, stride_dom, stride_dod, stride_dqam,
    offs_n, offs_d, start, end, Sq, lo, hi, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    MASKED: tl.constexpr, HAS_LO: tl.constexpr, HAS_HI: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ATOMIC_DQ: tl.constexpr, DQ_TMA: tl.constexpr, softcap_scale, SOFTCAP: tl.constexpr,
    WANT_DK: tl.constexpr = True, WANT_DV: tl.constexpr = True,
):
    """Query tiles [start, end) against one kv tile; MASKED applies the band and the ragged end of Sq."""
    offs_mb = tl.arange(0, BLOCK_M)
    q_tile = offs_mb[:, None] * stride_qm + offs_d[None, :] * stride_qd  # (BLOCK_M, BLOCK_D)
    do_tile = offs_mb[:, None] * stride_dom + offs_d[None, :] * stride_dod
    dqa_tile = offs_mb[:, None] * stride_dqam + offs_d[None, :]
    d_ok = offs_d[None, :] < HEAD_DIM
    for start_m in range(start, end, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        offs_m = start_m + offs_mb
        q_ptrs = Q_bh + start_m.to(tl.int64) * stride_qm + q_tile
        do_ptrs = DO_bh + start_m.to(tl.int64) * stride_dom + do_tile
        if MASKED:
            ld_mask = (offs_m[:, None] < Sq) & d_ok
        # -- load q; rows past Sq (zeros) get lse2 = +inf, so p = 0 and they add nothing --
        # (pointer loads: TMA descriptors for q / dO measured slower here, the loop reads both in two orientations)
        if MASKED:
            q = tl.load(q_ptrs, mask=ld_mask, other=0.0)
        elif BLOCK_D != HEAD_DIM:
            q = tl.load(q_ptrs, mask=d_ok, other=0.0)
        else:
            q = tl.load(q_ptrs)
        if MASKED:
            lse2 = tl.load(LSE2_bh + offs_m, mask=offs_m < Sq, other=float("inf"))
            delta = tl.load(DELTA_bh + offs_m, mask=offs_m < Sq, other=0.0)
        else:
            lse2 = tl.load(LSE2_bh + offs_m)
            delta = tl.load(DELTA_bh + offs_m)
        # -- recompute P^T (BLOCK_N, BLOCK_M) from the stored lse --
        qkT = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)
        if SOFTCAP:
            # the capped scores from the raw ones: t = tanh(scale * q.k / softcap), kept for the chain rule
            tT = _tanh(qkT * softcap_scale)
            qkT = tT
        pT = tl.math.exp2(qkT * qk_scale - lse2[None, :])
        if MASKED:
            diff = offs_n[:, None] - offs_m[None, :]  # j - i
            keep = offs_m[None, :] < Sq
            if HAS_LO:
                keep = keep & (diff >= lo)
            if HAS_HI:
                keep = keep & (diff <= hi)
            pT = tl.where(keep, pT, 0.0)
        if MASKED:
            do = tl.load(do_ptrs, mask=ld_mask, other=0.0)
        elif BLOCK_D != HEAD_DIM:
            do = tl.load(do_ptrs, mask=d_ok, other=0.0)
        else:
            do = tl.load(do_ptrs)
        # -- dV += P^T dO --
        if WANT_DV:
            dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        if WANT_DK:
            # -- dP^T = V dO^T, dS^T = P^T * (dP^T - Delta) --
            dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
            dsT = pT * (dpT - delta[None, :])
            if SOFTCAP:
                dsT = dsT * (1.0 - tT * tT)  # through the cap: d(softcap * tanh(x / softcap)) / dx = 1 - t^2
            dsT = dsT.to(q.dtype)
            # -- dK += dS^T Q (scale applied once at the end) --
            dk = tl.dot(dsT, q, dk, input_precision=DOT_PRECISION)
            if ATOMIC_DQ:
                # -- fast path: dQ += dS K straight into the float32 accumulator (atomics: not deterministic) --
                # (with the softmax scale here, the accumulator needs no extra pass afterwards)
                dq_part = tl.dot(tl.trans(dsT), k, input_precision=DOT_PRECISION) * sm_scale
                dqa_ptrs = DQA_bh + start_m.to(tl.int64) * stride_dqam + dqa_tile
                if DQ_TMA:
                    # one bulk reduction of the whole tile by the copy engine (rows past Sq are clipped by the
                    # descriptor) instead of BLOCK_M x BLOCK_D scalar red.global.add from the warps
                    desc_dqa.atomic_add([start_m, 0], dq_part)
                elif MASKED:
                    tl.atomic_add(dqa_ptrs, dq_part, mask=ld_mask, sem="relaxed")
                elif BLOCK_D != HEAD_DIM:
                    tl.atomic_add(dqa_ptrs, dq_part, mask=d_ok, sem="relaxed")
                else:
                    tl.atomic_add(dqa_ptrs, dq_part, sem="relaxed")
    return dk, dv


@triton.jit(do_not_specialize=["Sq", "Sk", "lo", "hi", "SEQ_BUCKET"])
def bwd_dkdv_kernel(
    Q, K, V, DO, LSE2, DELTA, DK, DV, DQA,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    stride_dqab, stride_dqah, stride_dqam,
    Hq, Hkv, Sq, Sk, GROUP, lo, hi, qk_scale, sm_scale, softcap_scale,
    SEQ_BUCKET,  # autotune key only (length bucket)
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_LO: tl.constexpr, HAS_HI: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ATOMIC_DQ: tl.constexpr = False, DQ_TMA: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
    WANT_DK: tl.constexpr = True, WANT_DV: tl.constexpr = True,
):
    """Grid: (B * Hkv, cdiv(Sk, BLOCK_N)). Writes dK and dV of one kv tile, summed over its query heads (only dK
    without WANT_DV, only dV without WANT_DK; ATOMIC_DQ needs WANT_DK).

    With ATOMIC_DQ it also adds scale dS K into DQA, a (B, Hq, Sq, D) float32 accumulator (unit stride on D);
    DQ_TMA (with ATOMIC_DQ) does each tile's addition as one TMA reduce (cp.reduce.async.bulk.tensor) through
    a tensor descriptor. SOFTCAP: the logit softcap (module docstring; qk_scale and softcap_scale as the forward's).
    """
    pid_bh = tl.program_id(0)
    pid_n = tl.program_id(1)
    off_b = pid_bh // Hkv
    off_kvh = pid_bh % Hkv
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    kv_mask = (offs_n[:, None] < Sk) & (offs_d[None, :] < HEAD_DIM)
    K_bh = K + off_b.to(tl.int64) * stride_kb + off_kvh.to(tl.int64) * stride_kh
    V_bh = V + off_b.to(tl.int64) * stride_vb + off_kvh.to(tl.int64) * stride_vh
    k = tl.load(K_bh + offs_n[:, None].to(tl.int64) * stride_kn + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
    v = tl.load(V_bh + offs_n[:, None].to(tl.int64) * stride_vn + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    # the query rows that see this kv tile: the band lo <= j - i <= hi read as -hi <= i - j <= -lo
    col_last = tl.minimum(start_n + BLOCK_N, Sk) - 1
    q_lo, full_lo, full_hi, q_end = _tile_ranges(start_n, col_last, Sq, -hi, -lo, HAS_HI, HAS_LO, BLOCK_M)
    for g in range(0, GROUP):
        off_h = off_kvh * GROUP + g
        row0 = (off_b * Hq + off_h).to(tl.int64) * Sq
        Q_bh = Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
        DO_bh = DO + off_b.to(tl.int64) * stride_dob + off_h.to(tl.int64) * stride_doh
        DQA_bh = DQA + off_b.to(tl.int64) * stride_dqab + off_h.to(tl.int64) * stride_dqah
        if DQ_TMA:
            desc_dqa = tl.make_tensor_descriptor(DQA_bh, shape=[Sq, HEAD_DIM], strides=[stride_dqam, 1], block_shape=[BLOCK_M, BLOCK_D])
        else:
            desc_dqa = DQA_bh
        # -- boundary query tiles, fully visible ones (no mask), boundary ones --
        dk, dv = _dkdv_inner(dk, dv, k, v, Q_bh, DO_bh, LSE2 + row0, DELTA + row0, DQA_bh, desc_dqa,
                             stride_qm, stride_qd, stride_dom, stride_dod, stride_dqam,
                             offs_n, offs_d, q_lo, full_lo, Sq, lo, hi, qk_scale, sm_scale,
                             HEAD_DIM, BLOCK_D, BLOCK_M, True, HAS_LO, HAS_HI, DOT_PRECISION, ATOMIC_DQ, DQ_TMA,
                             softcap_scale, SOFTCAP, WANT_DK, WANT_DV)
        dk, dv = _dkdv_inner(dk, dv, k, v, Q_bh, DO_bh, LSE2 + row0, DELTA + row0, DQA_bh, desc_dqa,
                             stride_qm, stride_qd, stride_dom, stride_dod, stride_dqam,
                             offs_n, offs_d, full_lo, full_hi, Sq, lo, hi, qk_scale, sm_scale,
                             HEAD_DIM, BLOCK_D, BLOCK_M, False, HAS_LO, HAS_HI, DOT_PRECISION, ATOMIC_DQ, DQ_TMA,
                             softcap_scale, SOFTCAP, WANT_DK, WANT_DV)
        dk, dv = _dkdv_inner(dk, dv, k, v, Q_bh, DO_bh, LSE2 + row0, DELTA + row0, DQA_bh, desc_dqa,
                             stride_qm, stride_qd, stride_dom, stride_dod, stride_dqam,
                             offs_n, offs_d, full_hi, q_end, Sq, lo, hi, qk_scale, sm_scale,
                             HEAD_DIM, BLOCK_D, BLOCK_M, True, HAS_LO, HAS_HI, DOT_PRECISION, ATOMIC_DQ, DQ_TMA,
                             softcap_scale, SOFTCAP, WANT_DK, WANT_DV)
    # epilogue: dK carries the softmax scale (s = scale * q.k); dV does not
    dk = dk * sm_scale
    DK_bh = DK + off_b.to(tl.int64) * stride_dkb + off_kvh.to(tl.int64) * stride_dkh
    DV_bh = DV + off_b.to(tl.int64) * stride_dvb + off_kvh.to(tl.int64) * stride_dvh
    if WANT_DK:
        tl.store(DK_bh + offs_n[:, None].to(tl.int64) * stride_dkn + offs_d[None, :] * stride_dkd, dk.to(DK.dtype.element_ty), mask=kv_mask)
    if WANT_DV:
        tl.store(DV_bh + offs_n[:, None].to(tl.int64) * stride_dvn + offs_d[None, :] * stride_dvd, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _dq_inner(
    dq, q, do, lse2, delta,
    K_bh, V_bh, stride_kn, stride_kd, stride_vn, stride_vd,
    offs_m, offs_d, start, end, Sk, lo, hi, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, HAS_LO: tl.constexpr, HAS_HI: tl.constexpr, DOT_PRECISION: tl.constexpr,
    softcap_scale, SOFTCAP: tl.constexpr,
):
    """Key tiles [start, end) of one query tile for dQ; MASKED applies the band and the ragged end of Sk."""
    offs_nb = tl.arange(0, BLOCK_N)
    k_tile = offs_nb[:, None] * stride_kn + offs_d[None, :] * stride_kd
    v_tile = offs_nb[:, None] * stride_vn + offs_d[None, :] * stride_vd
    d_ok = offs_d[None, :] < HEAD_DIM
    for start_n in range(start, end, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k_ptrs = K_bh + start_n.to(tl.int64) * stride_kn + k_tile
        v_ptrs = V_bh + start_n.to(tl.int64) * stride_vn + v_tile
        if MASKED:
            ld_mask = ((start_n + offs_nb)[:, None] < Sk) & d_ok
            k = tl.load(k_ptrs, mask=ld_mask, other=0.0)
            v = tl.load(v_ptrs, mask=ld_mask, other=0.0)
        elif BLOCK_D != HEAD_DIM:
            k = tl.load(k_ptrs, mask=d_ok, other=0.0)
            v = tl.load(v_ptrs, mask=d_ok, other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if SOFTCAP:
            t = _tanh(qk * softcap_scale)  # the capped scores from the raw ones, kept for the chain rule
            qk = t
        p = tl.math.exp2(qk * qk_scale - lse2[:, None])
        if MASKED:
            cols = start_n + offs_nb
            diff = cols[None, :] - offs_m[:, None]
            keep = cols[None, :] < Sk
            if HAS_LO:
                keep = keep & (diff >= lo)
            if HAS_HI:
                keep = keep & (diff <= hi)
            p = tl.where(keep, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - t * t)  # through the cap
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
    return dq


@triton.jit(do_not_specialize=["Sq", "Sk", "lo", "hi", "SEQ_BUCKET"])
def bwd_dq_kernel(
    Q, K, V, DO, LSE2, DELTA, DQ,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    Hq, Sq, Sk, GROUP, lo, hi, qk_scale, sm_scale, softcap_scale,
    SEQ_BUCKET,  # autotune key only (length bucket)
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_LO: tl.constexpr, HAS_HI: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    LONGEST_FIRST: tl.constexpr, DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr = False,
):
    """Grid: (B * Hq, cdiv(Sq, BLOCK_M)). Writes dQ of one query tile (the deterministic path); SOFTCAP as in
    `bwd_dkdv_kernel`."""
    pid_bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    if LONGEST_FIRST:
        pid_m = tl.num_programs(1) - 1 - pid_m
    off_b = pid_bh // Hq
    off_h = pid_bh % Hq
    off_kvh = off_h // GROUP
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < Sq
    mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    Q_bh = Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
    DO_bh = DO + off_b.to(tl.int64) * stride_dob + off_h.to(tl.int64) * stride_doh
    K_bh = K + off_b.to(tl.int64) * stride_kb + off_kvh.to(tl.int64) * stride_kh
    V_bh = V + off_b.to(tl.int64) * stride_vb + off_kvh.to(tl.int64) * stride_vh
    q = tl.load(Q_bh + offs_m[:, None].to(tl.int64) * stride_qm + offs_d[None, :] * stride_qd, mask=mask, other=0.0)
    do = tl.load(DO_bh + offs_m[:, None].to(tl.int64) * stride_dom + offs_d[None, :] * stride_dod, mask=mask, other=0.0)
    row = pid_bh.to(tl.int64) * Sq + offs_m
    lse2 = tl.load(LSE2 + row, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + row, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    row_last = tl.minimum(start_m + BLOCK_M, Sq) - 1
    k_lo, full_lo, full_hi, k_end = _tile_ranges(start_m, row_last, Sk, lo, hi, HAS_LO, HAS_HI, BLOCK_N)
    dq = _dq_inner(dq, q, do, lse2, delta, K_bh, V_bh, stride_kn, stride_kd, stride_vn, stride_vd,
                   offs_m, offs_d, k_lo, full_lo, Sk, lo, hi, qk_scale,
                   HEAD_DIM, BLOCK_D, BLOCK_N, True, HAS_LO, HAS_HI, DOT_PRECISION, softcap_scale, SOFTCAP)
    dq = _dq_inner(dq, q, do, lse2, delta, K_bh, V_bh, stride_kn, stride_kd, stride_vn, stride_vd,
                   offs_m, offs_d, full_lo, full_hi, Sk, lo, hi, qk_scale,
                   HEAD_DIM, BLOCK_D, BLOCK_N, False, HAS_LO, HAS_HI, DOT_PRECISION, softcap_scale, SOFTCAP)
    dq = _dq_inner(dq, q, do, lse2, delta, K_bh, V_bh, stride_kn, stride_kd, stride_vn, stride_vd,
                   offs_m, offs_d, full_hi, k_end, Sk, lo, hi, qk_scale,
                   HEAD_DIM, BLOCK_D, BLOCK_N, True, HAS_LO, HAS_HI, DOT_PRECISION, softcap_scale, SOFTCAP)
    dq = dq * sm_scale
    DQ_bh = DQ + off_b.to(tl.int64) * stride_dqb + off_h.to(tl.int64) * stride_dqh
    tl.store(DQ_bh + offs_m[:, None].to(tl.int64) * stride_dqm + offs_d[None, :] * stride_dqd,
             dq.to(DQ.dtype.element_ty), mask=mask)
