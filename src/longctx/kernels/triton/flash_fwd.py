"""FlashAttention-2 forward in Triton.

One program computes one tile of BLOCK_M queries of one query head: it streams the key/value tiles that
the band lets it see, keeps the running max ``m``, the running sum ``l`` and the output accumulator on chip,
and writes ``out`` and ``lse`` once.

Masking. Key j is visible to query i iff ``lo <= j - i <= hi`` (`longctx.masks.Band`; HAS_LO / HAS_HI say
whether a bound exists; lo and hi are arbitrary integers, so shifted bands from context parallelism work).
The key tiles of a query tile split into three runs (see `_tile_ranges`):

    [k_lo, full_lo)    boundary tiles before the fully visible run (window's left edge)   -> masked
    [full_lo, full_hi) tiles where every (query, key) pair is visible                     -> no mask at all
    [full_hi, k_end)   boundary tiles after it (causal diagonal, window's right edge, ragged Sk) -> masked

Tiles outside [k_lo, k_end) are never loaded. Masked entries get score -inf; a row that sees no key keeps
m = -inf, so the exponent uses a finite stand-in (0) there and the row ends with l = 0: output 0, lse -inf.

Scores are kept in base 2: ``s2 = (q . k) * scale * log2(e)`` and exp2 replaces exp. The running max and
the log-sum-exp are therefore in base 2 inside the kernel; the lse is converted to natural log (times
ln 2) once, in the epilogue, before it is stored.

Logit softcapping (SOFTCAP, Gemma 2): the scaled scores become ``softcap * tanh(scale * q.k / softcap)`` before
the mask. The launcher passes ``softcap_scale = scale / softcap`` and ``qk_scale = softcap * log2(e)``, and the
kernel replaces q.k by ``tanh(q.k * softcap_scale)`` right after the dot: the cap applies in natural units, and the
one multiplication by qk_scale that follows turns the capped score into base 2, as without SOFTCAP. With SOFTCAP
off (the default) the compiled code has no trace of it.

GQA/MQA: query head h reads kv head ``h // GROUP``; K and V are never repeated in memory.
Strides are passed for every tensor, so views such as the (B, S, H, D) layout need no copy.
"""

import triton
import triton.language as tl

# fmt: off
# (kernel signatures stay compact: one line per group of related arguments)

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _tanh(x):
    """tanh in float32 through exp2: (1 - e) / (1 + e) with e = exp(-2|x|), then the sign of x. No overflow for any
    x (e is in (0, 1]), exactly 0 at 0; runs compiled and under the interpreter (libdevice's tanh does not)."""
    e = tl.math.exp2(-2.8853900817779268 * tl.abs(x))  # 2 * log2(e)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _tma_rows(desc, off_b, off_h, start, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, HOST: tl.constexpr):
    """Rows [start, start + BLOCK) of one head through a tensor descriptor: with HOST a 4-D one over the whole
    (B, H, S, D) tensor, built on the host and passed by value (its block shape (1, 1, BLOCK, BLOCK_D)); else
    one over this head's (S, D) rows, built by the program itself. Rows past S arrive as zeros either way."""
    if HOST:
        t = desc.load([off_b, off_h, start, 0]).reshape([BLOCK, BLOCK_D])
    else:
        t = desc.load([start, 0])
    return t


@triton.jit
def _tile_ranges(row_start, row_last, n_cols, lo, hi, HAS_LO: tl.constexpr, HAS_HI: tl.constexpr, BLOCK: tl.constexpr):
    """Column runs for the rows [row_start, row_last] (inclusive; real rows only) of a band ``lo <= c - r <= hi``.

    Returns (c_lo, full_lo, full_hi, c_end): masked tiles [c_lo, full_lo), unmasked tiles [full_lo, full_hi),
    masked tiles [full_hi, c_end). c_lo, full_lo and full_hi are multiples of BLOCK; c_end is exclusive.
    """
    # -- columns any row may see: [c_start, c_end) --
    c_start = 0
    c_end = n_cols
    if HAS_LO:
        c_start = tl.maximum(row_start + lo, 0)
    if HAS_HI:
        c_end = tl.minimum(row_last + hi + 1, n_cols)
    c_lo = (tl.minimum(c_start, n_cols) // BLOCK) * BLOCK
    # no visible column: every run is empty (the rows end with l = 0)
    c_end = tl.where(c_end > c_start, c_end, c_lo)
    c_end_ceil = tl.cdiv(c_end, BLOCK) * BLOCK
    # -- columns every row sees: [f_start, f_end), shrunk to whole tiles --
    f_start = c_lo
    if HAS_LO:
        f_start = tl.maximum(f_start, row_last + lo)
    f_start = tl.cdiv(f_start, BLOCK) * BLOCK
    f_end = n_cols
    if HAS_HI:
        f_end = tl.minimum(f_end, row_start + hi + 1)
    f_end = (tl.maximum(f_end, 0) // BLOCK) * BLOCK
    full_lo = tl.minimum(tl.maximum(f_start, c_lo), c_end_ceil)
    full_hi = tl.minimum(tl.maximum(f_end, full_lo), c_end_ceil)
    full_hi = tl.maximum(full_hi, full_lo)
    return c_lo, full_lo, full_hi, c_end


@triton.jit
def _fwd_inner(
    acc, l_i, m_i, q,
    K_bh, V_bh, desc_k, desc_v, off_b, off_kvh, stride_kn, stride_kd, stride_vn, stride_vd,
    offs_m, offs_d, start, end, Sk, lo, hi, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, HAS_LO: tl.constexpr, HAS_HI: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr, TMA_HOST: tl.constexpr = False, softcap_scale=0.0, SOFTCAP: tl.constexpr = False,
):
    """Key tiles [start, end) of one query tile; MASKED applies the band and the ragged end of Sk."""
    offs_n = tl.arange(0, BLOCK_N)
    k_tile = offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd  # (BLOCK_N, BLOCK_D)
    v_tile = offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd
    d_ok = offs_d[None, :] < HEAD_DIM
    for start_n in tl.range(start, end, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k_ptrs = K_bh + start_n.to(tl.int64) * stride_kn + k_tile
        v_ptrs = V_bh + start_n.to(tl.int64) * stride_vn + v_tile
        if MASKED:
            ld_mask = ((start_n + offs_n)[:, None] < Sk) & d_ok
        # -- load K: only boundary tiles can reach past Sk; BLOCK_D > HEAD_DIM pads with zeros --
        if USE_TMA:
            # TMA (tensor descriptor): rows past Sk arrive as zeros, the mask below hides them
            k = _tma_rows(desc_k, off_b, off_kvh, start_n, BLOCK_N, BLOCK_D, TMA_HOST)
        elif MASKED:
            k = tl.load(k_ptrs, mask=ld_mask, other=0.0)
        elif BLOCK_D != HEAD_DIM:
            k = tl.load(k_ptrs, mask=d_ok, other=0.0)
        else:
            k = tl.load(k_ptrs)
        # -- scores (base 2) --
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if SOFTCAP:
            # logit softcap: q.k -> tanh(scale * q.k / softcap); times qk_scale = softcap * log2(e) below
            qk = _tanh(qk * softcap_scale)
        if MASKED:
            # boundary tile: the band and the ragged end of Sk, element by element
            cols = start_n + offs_n
            diff = cols[None, :] - offs_m[:, None]
            keep = cols[None, :] < Sk
            if HAS_LO:
                keep = keep & (diff >= lo)
            if HAS_HI:
                keep = keep & (diff <= hi)
            s = tl.where(keep, qk * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # a row with nothing visible yet keeps m = -inf: subtract 0 instead, exp2(-inf) = 0
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s - m_use[:, None])
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            m_use = m_new
            p = tl.math.exp2(qk * qk_scale - m_use[:, None])
        # -- online softmax update --
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if USE_TMA:
            v = _tma_rows(desc_v, off_b, off_kvh, start_n, BLOCK_N, BLOCK_D, TMA_HOST)
        elif MASKED:
            v = tl.load(v_ptrs, mask=ld_mask, other=0.0)
        elif BLOCK_D != HEAD_DIM:
            v = tl.load(v_ptrs, mask=d_ok, other=0.0)
        else:
            v = tl.load(v_ptrs)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _fwd_full_pipelined(acc, l_i, m_i, q, desc_k, desc_v, off_b, off_kvh, start, end, qk_scale,
                        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
                        TMA_HOST: tl.constexpr = False, softcap_scale=0.0, SOFTCAP: tl.constexpr = False):
    """The unmasked run, software-pipelined by hand: the scores of tile j+1 are issued (async wgmma) before
    the softmax of tile j, so the tensor cores can work while the exp2 units do (FlashAttention-3's
    intra-warpgroup overlap, as far as Triton's scheduler follows it). Needs TMA descriptors; [start, end)
    holds whole tiles."""
    if start < end:
        k = _tma_rows(desc_k, off_b, off_kvh, start, BLOCK_N, BLOCK_D, TMA_HOST)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        for start_n in range(start + BLOCK_N, end, BLOCK_N):
            start_n = tl.multiple_of(start_n, BLOCK_N)
            k = _tma_rows(desc_k, off_b, off_kvh, start_n, BLOCK_N, BLOCK_D, TMA_HOST)
            qk_next = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
            # -- online softmax of the previous tile while qk_next is in flight --
            acc, l_i, m_i = _softmax_pv(acc, l_i, m_i, qk, qk_scale, desc_v, off_b, off_kvh, start_n - BLOCK_N,
                                        BLOCK_N, BLOCK_D, DOT_PRECISION, TMA_HOST, softcap_scale, SOFTCAP)
            qk = qk_next
        # -- the last tile of the run --
        acc, l_i, m_i = _softmax_pv(acc, l_i, m_i, qk, qk_scale, desc_v, off_b, off_kvh, end - BLOCK_N,
                                    BLOCK_N, BLOCK_D, DOT_PRECISION, TMA_HOST, softcap_scale, SOFTCAP)
    return acc, l_i, m_i


@triton.jit
def _softmax_pv(acc, l_i, m_i, qk, qk_scale, desc_v, off_b, off_kvh, start_n, BLOCK_N: tl.constexpr,
                BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA_HOST: tl.constexpr,
                softcap_scale, SOFTCAP: tl.constexpr):
    """Online softmax of one unmasked tile's scores, then acc += P V (V through its tensor descriptor)."""
    if SOFTCAP:
        qk = _tanh(qk * softcap_scale)  # the logit softcap (see the module docstring)
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    p = tl.math.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    m_i = m_new
    v = _tma_rows(desc_v, off_b, off_kvh, start_n, BLOCK_N, BLOCK_D, TMA_HOST)
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["Sq", "Sk", "lo", "hi", "SEQ_BUCKET"])
def attn_fwd_kernel(
    Q, K, V, O, LSE, DESC_K, DESC_V,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    Hq, Sq, Sk, GROUP, lo, hi, qk_scale, softcap_scale,
    SEQ_BUCKET,  # autotune key only (length bucket)
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_LO: tl.constexpr, HAS_HI: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    LONGEST_FIRST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr = False, PIPE_QK: tl.constexpr = False, TMA_HOST: tl.constexpr = False,
    SOFTCAP: tl.constexpr = False,
):
    """Grid: (B * Hq, cdiv(Sq, BLOCK_M)) with LONGEST_FIRST, else (cdiv(Sq, BLOCK_M), B * Hq).

    LSE is (B, Hq, Sq) contiguous float32, natural log. USE_TMA loads K/V through tensor descriptors (needs
    unit stride on D, 16-byte aligned rows, HEAD_DIM == BLOCK_D); PIPE_QK runs the unmasked loop software-pipelined
    by hand (with USE_TMA; ignored without); TMA_HOST (with USE_TMA) takes DESC_K / DESC_V, 4-D descriptors over
    (B, Hkv, Sk, D) built on the host, instead of building a descriptor per program (broadcast views, whose stride-0
    dims a host descriptor cannot span; DESC_K / DESC_V are unused otherwise: pass K and V). SOFTCAP caps the scores
    (``qk_scale`` = softcap * log2(e), ``softcap_scale`` = scale / softcap); without it qk_scale = scale * log2(e)
    and softcap_scale is unused.
    """
    if LONGEST_FIRST:
        # causal-like bands: later query tiles see more keys. Heads vary fastest and query tiles run from
        # the last one down, so the longest programs start first (fewer stragglers in the last wave).
        pid_bh = tl.program_id(0)
        pid_m = tl.num_programs(1) - 1 - tl.program_id(1)
    else:
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
    if USE_TMA and TMA_HOST:
        desc_k = DESC_K
        desc_v = DESC_V
    elif USE_TMA:
        desc_k = tl.make_tensor_descriptor(K_bh, shape=[Sk, HEAD_DIM], strides=[stride_kn, 1], block_shape=[BLOCK_N, BLOCK_D])
        desc_v = tl.make_tensor_descriptor(V_bh, shape=[Sk, HEAD_DIM], strides=[stride_vn, 1], block_shape=[BLOCK_N, BLOCK_D])
    else:
        desc_k = K_bh
        desc_v = V_bh

    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < Sq
    q_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(Q_bh + offs_m[:, None].to(tl.int64) * stride_qm + offs_d[None, :] * stride_qd, mask=q_mask, other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    row_last = tl.minimum(start_m + BLOCK_M, Sq) - 1
    k_lo, full_lo, full_hi, k_end = _tile_ranges(start_m, row_last, Sk, lo, hi, HAS_LO, HAS_HI, BLOCK_N)
    # -- boundary tiles before the fully visible run --
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K_bh, V_bh, desc_k, desc_v, off_b, off_kvh,
                               stride_kn, stride_kd, stride_vn, stride_vd, offs_m, offs_d, k_lo, full_lo, Sk, lo, hi, qk_scale,
                               HEAD_DIM, BLOCK_D, BLOCK_N, True, HAS_LO, HAS_HI, DOT_PRECISION, USE_TMA, TMA_HOST,
                               softcap_scale, SOFTCAP)
    # -- fully visible tiles: no mask --
    if PIPE_QK and USE_TMA:
        acc, l_i, m_i = _fwd_full_pipelined(acc, l_i, m_i, q, desc_k, desc_v, off_b, off_kvh, full_lo, full_hi, qk_scale,
                                            BLOCK_N, BLOCK_D, DOT_PRECISION, TMA_HOST, softcap_scale, SOFTCAP)
    else:
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K_bh, V_bh, desc_k, desc_v, off_b, off_kvh,
                                   stride_kn, stride_kd, stride_vn, stride_vd, offs_m, offs_d, full_lo, full_hi, Sk, lo, hi,
                                   qk_scale, HEAD_DIM, BLOCK_D, BLOCK_N, False, HAS_LO, HAS_HI, DOT_PRECISION, USE_TMA,
                                   TMA_HOST, softcap_scale, SOFTCAP)
    # -- boundary tiles after it (diagonal, right window edge, ragged end of Sk) --
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K_bh, V_bh, desc_k, desc_v, off_b, off_kvh,
                               stride_kn, stride_kd, stride_vn, stride_vd, offs_m, offs_d, full_hi, k_end, Sk, lo, hi, qk_scale,
                               HEAD_DIM, BLOCK_D, BLOCK_N, True, HAS_LO, HAS_HI, DOT_PRECISION, USE_TMA, TMA_HOST,
                               softcap_scale, SOFTCAP)

    # epilogue: rows that saw no key have l = 0 -> output 0, lse -inf
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    # lse: base 2 inside the kernel (m and l of exp2), natural log in memory: multiply by ln 2 once here
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
    tl.store(LSE + pid_bh.to(tl.int64) * Sq + offs_m, lse, mask=row_ok)
    o_ptrs = O_bh + offs_m[:, None].to(tl.int64) * stride_om + offs_d[None, :] * stride_od
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=q_mask)
