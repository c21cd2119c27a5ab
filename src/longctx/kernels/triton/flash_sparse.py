"""Block-sparse FlashAttention in Triton: forward, dK/dV and dQ over the block lists of a `BlockMask`.

The mask is tiled in MASK_BS x MASK_BS blocks; the kernels tile inside them (BLOCK_M and BLOCK_N divide
MASK_BS). For each (batch, head, query block) the mask lists its full kv blocks and its partial kv blocks
(`longctx.masks`); a program walks

    for every full kv block, every BLOCK_N sub-tile:      no element mask (only the ragged end of Sk)
    for every partial kv block, every BLOCK_N sub-tile:   the element mask of MASK_KIND

and never touches an empty block. The backward's dK/dV programs walk the *transposed* lists (the query
blocks of each kv block) for every query head of their GQA group; dQ programs walk the same lists as the
forward. By default there are no atomics: the backward is deterministic.

MASK_KIND of partial blocks:

    0  none (a layout mask: every kept block is full; only bounds are checked)
    1  analytic "document band": per-token document ids and positions, loaded once per tile row/column:
           visible = (q_doc == k_doc and lo <= k_pos - q_pos <= hi) or k_idx < kv_global or q_idx < q_global
       (causal, sliding windows, packed documents / varlen, prefix-LM, local+global)
    2  stored tiles: one byte per entry of each partial block, ``TILE_IDS[b, h, qb, kb]`` indexes them
    3  kind 1 where it is an interval per token (`block_sparse.DocBand.intervals`: no global tokens, contiguous
       documents): the QDOC / QPOS slots hold each query's first / last visible key, KDOC / KPOS each key's
       first / last visible query (HAS_DOC set, so both are read); visible = both tests hold

Scores are in base 2 (``qk_scale = scale * log2(e)``, exp2); the lse is stored in natural log, converted
once in the forward's epilogue. The backward reads ``LSE2`` (base 2, +inf on rows that see nothing) and
``DELTA`` from `longctx.kernels.flash_bwd.bwd_preprocess_kernel`.

Logit softcapping (SOFTCAP) as in the dense kernels (`flash_fwd`, `flash_bwd`): q.k is replaced by
``tanh(q.k * softcap_scale)`` right after the dot (softcap_scale = scale / softcap, qk_scale = softcap * log2(e)),
and the backward multiplies dS by ``1 - tanh^2``. With SOFTCAP off (the default) the compiled code has no trace of it.

Every grid has the tile index fastest (first grid axis), so the programs in flight share one head's K/V
(forward, dQ) or q/dO (dK/dV) in L2. The walks read the next entry of the block list one iteration ahead, so
the K/V addresses do not wait on a load inside the iteration (the software pipeliner then keeps a K/V load in
flight). USE_TMA (forward): K/V tiles through tensor descriptors (unit stride on D, HEAD_DIM == BLOCK_D, a
CUDA device); pointer loads elsewhere (other strides, short sequences, the interpreter).
"""

import triton
import triton.language as tl

from longctx.kernels.triton.flash_fwd import _tanh

# fmt: off
# (kernel signatures stay compact: one line per group of related arguments)


# Lengths, window bounds and the mask tables' strides change with every sequence length and document packing:
# runtime integers, never specialised (Triton would compile another kernel whenever one became a multiple of 16).
_RUNTIME_INTS = [
    "Sq", "Sk", "lo", "hi", "SEQ_BUCKET", "stride_nb", "stride_nh", "stride_ib", "stride_ih", "stride_tb",
    "stride_th", "stride_tq", "kv_global", "q_global",
]


@triton.jit
def _visible(qi, kj, qd, kd, qp, kp, qb, kb, TILE_IDS_bh, stride_tq, TILES, Sk, lo, hi, kv_global, q_global,
             MASK_KIND: tl.constexpr, HAS_DOC: tl.constexpr, HAS_GLOBAL: tl.constexpr, MASK_BS: tl.constexpr):
    """Element mask of a partial block; every argument broadcasts (works for (M, N) and (N, M) tiles)."""
    keep = kj < Sk  # the ragged end of the keys
    if MASK_KIND == 1:
        diff = kp - qp
        vis = (diff >= lo) & (diff <= hi)
        if HAS_DOC:
            vis = vis & (qd == kd)
        if HAS_GLOBAL:
            vis = vis | (kj < kv_global) | (qi < q_global)
        keep = keep & vis
    elif MASK_KIND == 3:
        # the rule as per-token intervals (`DocBand.intervals`): qd / qp hold each query's first / last visible
        # key, kd / kp each key's first / last query (either side may pass -BIG / BIG where it was not read)
        keep = keep & (kj >= qd) & (kj <= qp) & (qi >= kd) & (qi <= kp)
    elif MASK_KIND == 2:
        tid = tl.load(TILE_IDS_bh + qb * stride_tq + kb).to(tl.int64)
        t = tl.load(TILES + tid * (MASK_BS * MASK_BS) + (qi - qb * MASK_BS) * MASK_BS + (kj - kb * MASK_BS))
        keep = keep & (t != 0)
    return keep


@triton.jit
def _load_kv_tile(P_bh, desc, start, stride_n, tile, offs_n, d_ok, Sk,
                  EVEN_SK: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, USE_TMA: tl.constexpr):
    """Rows [start, start + BLOCK_N) of K or V as a (BLOCK_N, BLOCK_D) tile; rows past Sk and columns past
    HEAD_DIM read as 0 (TMA zero-fills rows past Sk by itself)."""
    if USE_TMA:
        t = desc.load([start, 0])
    elif EVEN_SK:
        if BLOCK_D == HEAD_DIM:
            t = tl.load(P_bh + start.to(tl.int64) * stride_n + tile)
        else:
            t = tl.load(P_bh + start.to(tl.int64) * stride_n + tile, mask=d_ok, other=0.0)
    else:
        t = tl.load(P_bh + start.to(tl.int64) * stride_n + tile, mask=((start + offs_n)[:, None] < Sk) & d_ok, other=0.0)
    return t


@triton.jit
def _fwd_blocks(
    acc, l_i, m_i, q, K_bh, V_bh, desc_k, desc_v, stride_kn, stride_vn, k_tile, v_tile,
    IDX_row, n_blocks, qb, offs_m, qd, qp, KDOC_b, KPOS_b, TILE_IDS_bh, stride_tq, TILES,
    Sk, lo, hi, kv_global, q_global, qk_scale, d_ok,
    MASKED: tl.constexpr, EVEN_SK: tl.constexpr, MASK_KIND: tl.constexpr, HAS_DOC: tl.constexpr,
    HAS_GLOBAL: tl.constexpr, MASK_BS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
    softcap_scale, SOFTCAP: tl.constexpr,
):
    SUB: tl.constexpr = MASK_BS // BLOCK_N
    offs_n = tl.arange(0, BLOCK_N)
    n_iters = n_blocks * SUB
    kb_next = tl.load(IDX_row, mask=n_iters > 0, other=0)
    for j in range(0, n_iters):
        # -- the kv block of this sub-tile (the next one's entry read ahead) --
        kb = kb_next
        kb_next = tl.load(IDX_row + (j + 1) // SUB, mask=j + 1 < n_iters, other=0)
        start_n = kb * MASK_BS + (j % SUB) * BLOCK_N
        cols = start_n + offs_n
        # -- load K, V (the last block may reach past Sk) --
        k = _load_kv_tile(K_bh, desc_k, start_n, stride_kn, k_tile, offs_n, d_ok, Sk, EVEN_SK, BLOCK_D, HEAD_DIM, USE_TMA)
        v = _load_kv_tile(V_bh, desc_v, start_n, stride_vn, v_tile, offs_n, d_ok, Sk, EVEN_SK, BLOCK_D, HEAD_DIM, USE_TMA)
        # -- scores (base 2) --
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if SOFTCAP:
            # logit softcap: q.k -> tanh(scale * q.k / softcap); times qk_scale = softcap * log2(e) below
            qk = _tanh(qk * softcap_scale)
        if MASKED:
            # partial block: the element mask of MASK_KIND
            # per-key document ids / positions, as (1, BLOCK_N) rows (zeros when unused)
            kd = tl.zeros([1, BLOCK_N], dtype=tl.int32)
            kp = tl.zeros([1, BLOCK_N], dtype=tl.int32)
            if MASK_KIND == 1 or MASK_KIND == 3:
                if HAS_DOC:
                    kd = tl.load(KDOC_b + cols, mask=cols < Sk, other=-2)[None, :]
                kp = tl.load(KPOS_b + cols, mask=cols < Sk, other=0)[None, :]
            keep = _visible(offs_m[:, None], cols[None, :], qd[:, None], kd, qp[:, None], kp, qb, kb, TILE_IDS_bh,
                            stride_tq, TILES, Sk, lo, hi, kv_global, q_global, MASK_KIND, HAS_DOC, HAS_GLOBAL, MASK_BS)
            s = tl.where(keep, qk * qk_scale, float("-inf"))
        elif EVEN_SK:
            s = qk * qk_scale
        else:
            s = tl.where(cols[None, :] < Sk, qk * qk_scale, float("-inf"))
        # -- online softmax update --
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if MASKED:
            # a row with nothing visible yet keeps m = -inf: subtract 0 instead (exp2(-inf) = 0)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            # full blocks run first and their first sub-tile always holds in-range keys: m is finite
            m_use = m_new
        p = tl.math.exp2(s - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=_RUNTIME_INTS + ["stride_iq"])
def sparse_fwd_kernel(
    Q, K, V, O, LSE,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    KV_NUM, KV_IDX, FULL_NUM, FULL_IDX, stride_nb, stride_nh, stride_ib, stride_ih, stride_iq,
    QDOC, KDOC, QPOS, KPOS, stride_qdoc, stride_kdoc, TILES, TILE_IDS, stride_tb, stride_th, stride_tq,
    Hq, Sq, Sk, GROUP, lo, hi, kv_global, q_global, qk_scale, softcap_scale,
    SEQ_BUCKET,  # autotune key only (length bucket)
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASK_BS: tl.constexpr, MASK_KIND: tl.constexpr,
    HAS_DOC: tl.constexpr, HAS_GLOBAL: tl.constexpr, EVEN_SK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
    SOFTCAP: tl.constexpr = False,
):
    """Grid: (cdiv(Sq, BLOCK_M), B * Hq). Mask tensors are pre-expanded to (B, Hq, ...) (stride 0 broadcasts);
    the block lists' last dim and the per-token tensors' last dim are contiguous. LSE (B, Hq, Sq) natural log."""
    # query tiles vary fastest: the programs in flight share one head's K/V in L2
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = pid_bh // Hq
    off_h = pid_bh % Hq
    off_kvh = off_h // GROUP
    Q_bh = Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
    K_bh = K + off_b.to(tl.int64) * stride_kb + off_kvh.to(tl.int64) * stride_kh
    V_bh = V + off_b.to(tl.int64) * stride_vb + off_kvh.to(tl.int64) * stride_vh
    O_bh = O + off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh
    if USE_TMA:
        desc_k = tl.make_tensor_descriptor(K_bh, shape=[Sk, HEAD_DIM], strides=[stride_kn, 1], block_shape=[BLOCK_N, BLOCK_D])
        desc_v = tl.make_tensor_descriptor(V_bh, shape=[Sk, HEAD_DIM], strides=[stride_vn, 1], block_shape=[BLOCK_N, BLOCK_D])
    else:
        desc_k = K_bh
        desc_v = V_bh

    start_m = pid_m * BLOCK_M
    qb = start_m // MASK_BS  # the mask's query block (BLOCK_M divides MASK_BS)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    row_ok = offs_m < Sq
    d_ok = offs_d[None, :] < HEAD_DIM
    q = tl.load(Q_bh + offs_m[:, None].to(tl.int64) * stride_qm + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None] & d_ok, other=0.0)
    k_tile = offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd
    v_tile = offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd

    # -- the block lists of this (batch, head, query block) --
    nb = off_b.to(tl.int64) * stride_nb + off_h.to(tl.int64) * stride_nh + qb
    ib = off_b.to(tl.int64) * stride_ib + off_h.to(tl.int64) * stride_ih + qb.to(tl.int64) * stride_iq
    n_full = tl.load(FULL_NUM + nb)
    n_part = tl.load(KV_NUM + nb)
    TILE_IDS_bh = TILE_IDS + off_b.to(tl.int64) * stride_tb + off_h.to(tl.int64) * stride_th
    KDOC_b = KDOC + off_b.to(tl.int64) * stride_kdoc
    KPOS_b = KPOS + off_b.to(tl.int64) * stride_kdoc
    if MASK_KIND == 1 or MASK_KIND == 3:
        if HAS_DOC:
            qd = tl.load(QDOC + off_b.to(tl.int64) * stride_qdoc + offs_m, mask=row_ok, other=-1)
        else:
            qd = tl.zeros([BLOCK_M], dtype=tl.int32)
        qp = tl.load(QPOS + off_b.to(tl.int64) * stride_qdoc + offs_m, mask=row_ok, other=0)
    else:
        qd = tl.zeros([BLOCK_M], dtype=tl.int32)
        qp = tl.zeros([BLOCK_M], dtype=tl.int32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # -- full blocks: no element mask --
    acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, K_bh, V_bh, desc_k, desc_v, stride_kn, stride_vn, k_tile, v_tile,
                                FULL_IDX + ib, n_full, qb, offs_m, qd, qp, KDOC_b, KPOS_b, TILE_IDS_bh, stride_tq, TILES,
                                Sk, lo, hi, kv_global, q_global, qk_scale, d_ok,
                                False, EVEN_SK, MASK_KIND, HAS_DOC, HAS_GLOBAL, MASK_BS, BLOCK_N, BLOCK_D, HEAD_DIM,
                                DOT_PRECISION, USE_TMA, softcap_scale, SOFTCAP)
    # -- partial blocks: element mask --
    acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, K_bh, V_bh, desc_k, desc_v, stride_kn, stride_vn, k_tile, v_tile,
                                KV_IDX + ib, n_part, qb, offs_m, qd, qp, KDOC_b, KPOS_b, TILE_IDS_bh, stride_tq, TILES,
                                Sk, lo, hi, kv_global, q_global, qk_scale, d_ok,
                                True, EVEN_SK, MASK_KIND, HAS_DOC, HAS_GLOBAL, MASK_BS, BLOCK_N, BLOCK_D, HEAD_DIM,
                                DOT_PRECISION, USE_TMA, softcap_scale, SOFTCAP)
    # -- epilogue: normalise; a row that saw nothing has l = 0: output 0, lse -inf; lse to natural log --
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
    tl.store(O_bh + offs_m[:, None].to(tl.int64) * stride_om + offs_d[None, :] * stride_od, out.to(O.dtype.element_ty),
             mask=row_ok[:, None] & d_ok)
    tl.store(LSE + pid_bh.to(tl.int64) * Sq + offs_m, lse, mask=row_ok)


@triton.jit
def _dq_blocks(
    dq, q, do, lse2, delta, K_bh, V_bh, stride_kn, stride_vn, k_tile, v_tile,
    IDX_row, n_blocks, qb, offs_m, qd, qp, KDOC_b, KPOS_b, TILE_IDS_bh, stride_tq, TILES,
    Sk, lo, hi, kv_global, q_global, qk_scale, d_ok,
    MASKED: tl.constexpr, EVEN_SK: tl.constexpr, MASK_KIND: tl.constexpr, HAS_DOC: tl.constexpr,
    HAS_GLOBAL: tl.constexpr, MASK_BS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr, softcap_scale, SOFTCAP: tl.constexpr,
):
    SUB: tl.constexpr = MASK_BS // BLOCK_N
    offs_n = tl.arange(0, BLOCK_N)
    n_iters = n_blocks * SUB
    kb_next = tl.load(IDX_row, mask=n_iters > 0, other=0)
    for j in range(0, n_iters):
        kb = kb_next
        kb_next = tl.load(IDX_row + (j + 1) // SUB, mask=j + 1 < n_iters, other=0)
        start_n = kb * MASK_BS + (j % SUB) * BLOCK_N
        cols = start_n + offs_n
        k = _load_kv_tile(K_bh, K_bh, start_n, stride_kn, k_tile, offs_n, d_ok, Sk, EVEN_SK, BLOCK_D, HEAD_DIM, False)
        v = _load_kv_tile(V_bh, V_bh, start_n, stride_vn, v_tile, offs_n, d_ok, Sk, EVEN_SK, BLOCK_D, HEAD_DIM, False)
        # -- recompute the probabilities (base 2) --
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if SOFTCAP:
            t = _tanh(qk * softcap_scale)  # the capped scores from the raw ones, kept for the chain rule
            qk = t
        p = tl.math.exp2(qk * qk_scale - lse2[:, None])
        if MASKED:
            # per-key document ids / positions, as (1, BLOCK_N) rows (zeros when unused)
            kd = tl.zeros([1, BLOCK_N], dtype=tl.int32)
            kp = tl.zeros([1, BLOCK_N], dtype=tl.int32)
            if MASK_KIND == 1 or MASK_KIND == 3:
                if HAS_DOC:
                    kd = tl.load(KDOC_b + cols, mask=cols < Sk, other=-2)[None, :]
                kp = tl.load(KPOS_b + cols, mask=cols < Sk, other=0)[None, :]
            keep = _visible(offs_m[:, None], cols[None, :], qd[:, None], kd, qp[:, None], kp, qb, kb, TILE_IDS_bh,
                            stride_tq, TILES, Sk, lo, hi, kv_global, q_global, MASK_KIND, HAS_DOC, HAS_GLOBAL, MASK_BS)
            p = tl.where(keep, p, 0.0)
        elif not EVEN_SK:
            p = tl.where(cols[None, :] < Sk, p, 0.0)
        # -- dP = dO V^T ; dS = P * (dP - Delta) ; dQ += dS K --
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - t * t)  # through the cap
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
    return dq


@triton.jit(do_not_specialize=_RUNTIME_INTS + ["stride_iq"])
def sparse_bwd_dq_kernel(
    Q, K, V, DO, LSE2, DELTA, DQ,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    KV_NUM, KV_IDX, FULL_NUM, FULL_IDX, stride_nb, stride_nh, stride_ib, stride_ih, stride_iq,
    QDOC, KDOC, QPOS, KPOS, stride_qdoc, stride_kdoc, TILES, TILE_IDS, stride_tb, stride_th, stride_tq,
    Hq, Sq, Sk, GROUP, lo, hi, kv_global, q_global, qk_scale, sm_scale, softcap_scale,
    SEQ_BUCKET,  # autotune key only (length bucket)
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASK_BS: tl.constexpr, MASK_KIND: tl.constexpr,
    HAS_DOC: tl.constexpr, HAS_GLOBAL: tl.constexpr, EVEN_SK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr = False,
):
    """Grid: (cdiv(Sq, BLOCK_M), B * Hq): one query tile, streaming its kv blocks (as the forward)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = pid_bh // Hq
    off_h = pid_bh % Hq
    off_kvh = off_h // GROUP
    K_bh = K + off_b.to(tl.int64) * stride_kb + off_kvh.to(tl.int64) * stride_kh
    V_bh = V + off_b.to(tl.int64) * stride_vb + off_kvh.to(tl.int64) * stride_vh
    start_m = pid_m * BLOCK_M
    qb = start_m // MASK_BS
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    row_ok = offs_m < Sq
    d_ok = offs_d[None, :] < HEAD_DIM
    ld = row_ok[:, None] & d_ok
    q = tl.load(Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
                + offs_m[:, None].to(tl.int64) * stride_qm + offs_d[None, :] * stride_qd, mask=ld, other=0.0)
    do = tl.load(DO + off_b.to(tl.int64) * stride_dob + off_h.to(tl.int64) * stride_doh
                 + offs_m[:, None].to(tl.int64) * stride_dom + offs_d[None, :] * stride_dod, mask=ld, other=0.0)
    row = pid_bh.to(tl.int64) * Sq + offs_m
    lse2 = tl.load(LSE2 + row, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + row, mask=row_ok, other=0.0)
    k_tile = offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd
    v_tile = offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd
    nb = off_b.to(tl.int64) * stride_nb + off_h.to(tl.int64) * stride_nh + qb
    ib = off_b.to(tl.int64) * stride_ib + off_h.to(tl.int64) * stride_ih + qb.to(tl.int64) * stride_iq
    n_full = tl.load(FULL_NUM + nb)
    n_part = tl.load(KV_NUM + nb)
    TILE_IDS_bh = TILE_IDS + off_b.to(tl.int64) * stride_tb + off_h.to(tl.int64) * stride_th
    KDOC_b = KDOC + off_b.to(tl.int64) * stride_kdoc
    KPOS_b = KPOS + off_b.to(tl.int64) * stride_kdoc
    if MASK_KIND == 1 or MASK_KIND == 3:
        if HAS_DOC:
            qd = tl.load(QDOC + off_b.to(tl.int64) * stride_qdoc + offs_m, mask=row_ok, other=-1)
        else:
            qd = tl.zeros([BLOCK_M], dtype=tl.int32)
        qp = tl.load(QPOS + off_b.to(tl.int64) * stride_qdoc + offs_m, mask=row_ok, other=0)
    else:
        qd = tl.zeros([BLOCK_M], dtype=tl.int32)
        qp = tl.zeros([BLOCK_M], dtype=tl.int32)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    dq = _dq_blocks(dq, q, do, lse2, delta, K_bh, V_bh, stride_kn, stride_vn, k_tile, v_tile,
                    FULL_IDX + ib, n_full, qb, offs_m, qd, qp, KDOC_b, KPOS_b, TILE_IDS_bh, stride_tq, TILES,
                    Sk, lo, hi, kv_global, q_global, qk_scale, d_ok,
                    False, EVEN_SK, MASK_KIND, HAS_DOC, HAS_GLOBAL, MASK_BS, BLOCK_N, BLOCK_D, HEAD_DIM, DOT_PRECISION,
                    softcap_scale, SOFTCAP)
    dq = _dq_blocks(dq, q, do, lse2, delta, K_bh, V_bh, stride_kn, stride_vn, k_tile, v_tile,
                    KV_IDX + ib, n_part, qb, offs_m, qd, qp, KDOC_b, KPOS_b, TILE_IDS_bh, stride_tq, TILES,
                    Sk, lo, hi, kv_global, q_global, qk_scale, d_ok,
                    True, EVEN_SK, MASK_KIND, HAS_DOC, HAS_GLOBAL, MASK_BS, BLOCK_N, BLOCK_D, HEAD_DIM, DOT_PRECISION,
                    softcap_scale, SOFTCAP)
    # -- epilogue: the scale of S = scale * q k^T --
    tl.store(DQ + off_b.to(tl.int64) * stride_dqb + off_h.to(tl.int64) * stride_dqh
             + offs_m[:, None].to(tl.int64) * stride_dqm + offs_d[None, :] * stride_dqd,
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=ld)


@triton.jit
def _dkdv_blocks(
    dk, dv, k, v, Q_bh, DO_bh, LSE2_bh, DELTA_bh, stride_qm, stride_dom, q_tile, do_tile,
    IDX_row, n_blocks, kb, offs_n, kd, kp, QDOC_b, QPOS_b, TILE_IDS_bh, stride_tq, TILES,
    Sq, Sk, lo, hi, kv_global, q_global, qk_scale, d_ok,
    MASKED: tl.constexpr, MASK_KIND: tl.constexpr, HAS_DOC: tl.constexpr, HAS_GLOBAL: tl.constexpr,
    MASK_BS: tl.constexpr, BLOCK_M: tl.constexpr, DOT_PRECISION: tl.constexpr, softcap_scale, SOFTCAP: tl.constexpr,
):
    SUB: tl.constexpr = MASK_BS // BLOCK_M
    offs_mb = tl.arange(0, BLOCK_M)
    n_iters = n_blocks * SUB
    qb_next = tl.load(IDX_row, mask=n_iters > 0, other=0)
    for j in range(0, n_iters):
        qb = qb_next
        qb_next = tl.load(IDX_row + (j + 1) // SUB, mask=j + 1 < n_iters, other=0)
        start_m = qb * MASK_BS + (j % SUB) * BLOCK_M
        rows = start_m + offs_mb
        row_ok = rows < Sq
        ld = row_ok[:, None] & d_ok
        q = tl.load(Q_bh + start_m.to(tl.int64) * stride_qm + q_tile, mask=ld, other=0.0)
        do = tl.load(DO_bh + start_m.to(tl.int64) * stride_dom + do_tile, mask=ld, other=0.0)
        lse2 = tl.load(LSE2_bh + rows, mask=row_ok, other=float("inf"))
        delta = tl.load(DELTA_bh + rows, mask=row_ok, other=0.0)
        # -- transposed scores: (BLOCK_N keys, BLOCK_M queries) --
        qkT = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)
        if SOFTCAP:
            tT = _tanh(qkT * softcap_scale)  # the capped scores from the raw ones, kept for the chain rule
            qkT = tT
        pT = tl.math.exp2(qkT * qk_scale - lse2[None, :])
        if MASKED:
            # per-query document ids / positions, as (1, BLOCK_M) rows (zeros when unused)
            qd = tl.zeros([1, BLOCK_M], dtype=tl.int32)
            qp = tl.zeros([1, BLOCK_M], dtype=tl.int32)
            if MASK_KIND == 1 or MASK_KIND == 3:
                if HAS_DOC:
                    qd = tl.load(QDOC_b + rows, mask=row_ok, other=-1)[None, :]
                qp = tl.load(QPOS_b + rows, mask=row_ok, other=0)[None, :]
            keep = _visible(rows[None, :], offs_n[:, None], qd, kd[:, None], qp, kp[:, None], qb, kb, TILE_IDS_bh,
                            stride_tq, TILES, Sk, lo, hi, kv_global, q_global, MASK_KIND, HAS_DOC, HAS_GLOBAL, MASK_BS)
            pT = tl.where(keep, pT, 0.0)
        # -- dV += P^T dO ; dP^T = V dO^T ; dS^T = P^T * (dP^T - Delta) ; dK += dS^T Q --
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        dsT = pT * (dpT - delta[None, :])
        if SOFTCAP:
            dsT = dsT * (1.0 - tT * tT)  # through the cap
        dk = tl.dot(dsT.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit(do_not_specialize=_RUNTIME_INTS + ["stride_ik"])
def sparse_bwd_dkdv_kernel(
    Q, K, V, DO, LSE2, DELTA, DK, DV,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    Q_NUM, Q_IDX, FULL_NUM, FULL_IDX, stride_nb, stride_nh, stride_ib, stride_ih, stride_ik,
    QDOC, KDOC, QPOS, KPOS, stride_qdoc, stride_kdoc, TILES, TILE_IDS, stride_tb, stride_th, stride_tq,
    Hq, Hkv, Sq, Sk, GROUP, lo, hi, kv_global, q_global, qk_scale, sm_scale, softcap_scale,
    SEQ_BUCKET,  # autotune key only (length bucket)
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASK_BS: tl.constexpr, MASK_KIND: tl.constexpr,
    HAS_DOC: tl.constexpr, HAS_GLOBAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr = False,
):
    """Grid: (cdiv(Sk, BLOCK_N), B * Hkv): one kv tile; loops over the GROUP query heads sharing it and, for
    each, over the transposed lists of its mask block (full blocks first, then partial ones)."""
    # kv tiles vary fastest: the programs in flight share one head's q and dO in L2
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = pid_bh // Hkv
    off_kvh = pid_bh % Hkv
    start_n = pid_n * BLOCK_N
    kb = start_n // MASK_BS  # the mask's kv block (BLOCK_N divides MASK_BS)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    col_ok = offs_n < Sk
    d_ok = offs_d[None, :] < HEAD_DIM
    ldk = col_ok[:, None] & d_ok
    k = tl.load(K + off_b.to(tl.int64) * stride_kb + off_kvh.to(tl.int64) * stride_kh
                + offs_n[:, None].to(tl.int64) * stride_kn + offs_d[None, :] * stride_kd, mask=ldk, other=0.0)
    v = tl.load(V + off_b.to(tl.int64) * stride_vb + off_kvh.to(tl.int64) * stride_vh
                + offs_n[:, None].to(tl.int64) * stride_vn + offs_d[None, :] * stride_vd, mask=ldk, other=0.0)
    if MASK_KIND == 1 or MASK_KIND == 3:
        if HAS_DOC:
            kd = tl.load(KDOC + off_b.to(tl.int64) * stride_kdoc + offs_n, mask=col_ok, other=-2)
        else:
            kd = tl.zeros([BLOCK_N], dtype=tl.int32)
        kp = tl.load(KPOS + off_b.to(tl.int64) * stride_kdoc + offs_n, mask=col_ok, other=0)
    else:
        kd = tl.zeros([BLOCK_N], dtype=tl.int32)
        kp = tl.zeros([BLOCK_N], dtype=tl.int32)
    q_tile = offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd
    do_tile = offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod
    QDOC_b = QDOC + off_b.to(tl.int64) * stride_qdoc
    QPOS_b = QPOS + off_b.to(tl.int64) * stride_qdoc
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for g in range(0, GROUP):
        off_h = off_kvh * GROUP + g
        Q_bh = Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
        DO_bh = DO + off_b.to(tl.int64) * stride_dob + off_h.to(tl.int64) * stride_doh
        row0 = (off_b * Hq + off_h).to(tl.int64) * Sq
        nb = off_b.to(tl.int64) * stride_nb + off_h.to(tl.int64) * stride_nh + kb
        ib = off_b.to(tl.int64) * stride_ib + off_h.to(tl.int64) * stride_ih + kb.to(tl.int64) * stride_ik
        TILE_IDS_bh = TILE_IDS + off_b.to(tl.int64) * stride_tb + off_h.to(tl.int64) * stride_th
        n_full = tl.load(FULL_NUM + nb)
        n_part = tl.load(Q_NUM + nb)
        dk, dv = _dkdv_blocks(dk, dv, k, v, Q_bh, DO_bh, LSE2 + row0, DELTA + row0, stride_qm, stride_dom, q_tile, do_tile,
                              FULL_IDX + ib, n_full, kb, offs_n, kd, kp, QDOC_b, QPOS_b, TILE_IDS_bh, stride_tq, TILES,
                              Sq, Sk, lo, hi, kv_global, q_global, qk_scale, d_ok,
                              False, MASK_KIND, HAS_DOC, HAS_GLOBAL, MASK_BS, BLOCK_M, DOT_PRECISION, softcap_scale, SOFTCAP)
        dk, dv = _dkdv_blocks(dk, dv, k, v, Q_bh, DO_bh, LSE2 + row0, DELTA + row0, stride_qm, stride_dom, q_tile, do_tile,
                              Q_IDX + ib, n_part, kb, offs_n, kd, kp, QDOC_b, QPOS_b, TILE_IDS_bh, stride_tq, TILES,
                              Sq, Sk, lo, hi, kv_global, q_global, qk_scale, d_ok,
                              True, MASK_KIND, HAS_DOC, HAS_GLOBAL, MASK_BS, BLOCK_M, DOT_PRECISION, softcap_scale, SOFTCAP)
    # -- epilogue: dK carries the scale of S = scale * q k^T --
    tl.store(DK + off_b.to(tl.int64) * stride_dkb + off_kvh.to(tl.int64) * stride_dkh
             + offs_n[:, None].to(tl.int64) * stride_dkn + offs_d[None, :] * stride_dkd,
             (dk * sm_scale).to(DK.dtype.element_ty), mask=ldk)
    tl.store(DV + off_b.to(tl.int64) * stride_dvb + off_kvh.to(tl.int64) * stride_dvh
             + offs_n[:, None].to(tl.int64) * stride_dvn + offs_d[None, :] * stride_dvd,
             dv.to(DV.dtype.element_ty), mask=ldk)
