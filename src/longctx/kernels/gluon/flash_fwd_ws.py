"""FlashAttention forward for Hopper, warp-specialised, in Gluon (Triton's lower-level language).

Why a second forward kernel. The `flash_fwd` kernel (Triton) keeps every warp on the same instruction stream:
each iteration the compiler puts CTA-wide barriers (``bar.sync``) around the TMA loads and after the QK^T wait,
so the two warpgroups of a 128-row tile run their softmax at the same moment and the tensor cores idle
meanwhile (the SASS of the 128x128 tile has 3 ``BAR.SYNC`` per key tile). Hopper's answer
(FlashAttention-3) is warp specialisation: one producer warp issues the TMA loads and two consumer warpgroups
each own 64 query rows. They synchronise only through mbarriers (a "ready" and an "empty" barrier per shared
memory stage), so one warpgroup's exp2 can run while the other's wgmma does. Triton 3.6 expresses this on
Hopper only through Gluon (`gl.warp_specialize`), hence this file.

Partitions (all in one CTA, one tile of ``2 * 64`` query rows of one query head):

- consumer 0 (the default partition, 4 warps) and consumer 1 (a worker, 4 warps): rows
  ``[start_m + 64 w, start_m + 64 (w + 1))``; online softmax in base 2 with the scores and the output
  accumulator in registers (wgmma layout), the probabilities fed to the second wgmma from registers.
- producer (a worker, 1 warp, few registers): Q once, then the K and V tiles the band lets the CTA see, into a
  ring of ``STAGES`` shared-memory slots.

Semantics are those of `flash_fwd.attn_fwd_kernel` (band ``lo <= j - i <= hi``, three runs of key tiles:
masked / unmasked / masked, rows that see nothing give 0 and lse -inf, GQA by ``h // GROUP``, lse in natural
log). Descriptors are 4-D over (B, H, S, D), built on the host, so (B, S, H, D) views work without a copy;
TMA fills rows past S with zeros, and the mask hides them.

Logit softcapping (SOFTCAP) as in `flash_fwd`: the raw scores q.k become ``tanh(q.k * softcap_scale)`` before the
softmax (`_cap`; softcap_scale = scale / softcap, qk_scale = softcap * log2(e)), the tanh by the hardware's
approximation (`_tanh`). With SOFTCAP off (the default) the compiled code has no trace of it.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from longctx.kernels.triton.flash_fwd import _tile_ranges

# fmt: off

# Gluon is experimental and renames things between Triton releases: the TMA load is `async_load` from Triton
# 3.7 on, `async_copy_global_to_shared` in 3.6 (the device machine's).
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

WG_ROWS = gl.constexpr(64)  # query rows per consumer warpgroup (one m64 wgmma row block)
NUM_CONSUMERS = gl.constexpr(2)


@gluon.constexpr_function
def wgmma_layout(n):
    """Register layout of a warpgroup's 64 x n wgmma accumulator (its 4 warps stacked along the rows)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


@gluon.jit
def _program(Sq, Hq, GROUP, LONGEST_FIRST: gl.constexpr, BLOCK_M: gl.constexpr):
    """(batch, query head, kv head, first row) of this CTA; causal-like bands run their longest tiles first."""
    if LONGEST_FIRST:
        pid_bh = gl.program_id(0)
        pid_m = gl.num_programs(1) - 1 - gl.program_id(1)
    else:
        pid_m = gl.program_id(0)
        pid_bh = gl.program_id(1)
    off_b = pid_bh // Hq
    off_h = pid_bh % Hq
    return off_b, off_h, off_h // GROUP, pid_m * BLOCK_M


@gluon.jit
def _producer(desc_q, desc_k, desc_v, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
              Sq, Sk, Hq, GROUP, lo, hi,
              HAS_LO: gl.constexpr, HAS_HI: gl.constexpr, LONGEST_FIRST: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, STAGES: gl.constexpr):
    """One warp: Q of both consumers, then every K/V tile of [k_lo, k_end) in order, STAGES slots ahead."""
    off_b, off_h, off_kvh, start_m = _program(Sq, Hq, GROUP, LONGEST_FIRST, BLOCK_M)
    row_last = gl.minimum(start_m + BLOCK_M, Sq) - 1
    k_lo, full_lo, full_hi, k_end = _tile_ranges(start_m, row_last, Sk, lo, hi, HAS_LO, HAS_HI, BLOCK_N)
    for w in gl.static_range(NUM_CONSUMERS):
        bar = q_bar.index(w)
        mbarrier.expect(bar, desc_q.block_type.nbytes)
        _tma_load(desc_q, [off_b, off_h, start_m + w * WG_ROWS, 0], bar, q_smem.index(w))
    i = 0
    for start_n in range(k_lo, k_end, BLOCK_N):
        s = i % STAGES
        ph = (i // STAGES) & 1
        # the slot is free once both consumers released it (the barriers start "complete": the first round passes)
        mbarrier.wait(k_empty.index(s), ph ^ 1)
        mbarrier.expect(k_ready.index(s), desc_k.block_type.nbytes)
        _tma_load(desc_k, [off_b, off_kvh, start_n, 0], k_ready.index(s), k_smem.index(s))
        mbarrier.wait(v_empty.index(s), ph ^ 1)
        mbarrier.expect(v_ready.index(s), desc_v.block_type.nbytes)
        _tma_load(desc_v, [off_b, off_kvh, start_n, 0], v_ready.index(s), v_smem.index(s))
        i += 1  # noqa: SIM113 (Gluon loops have no enumerate)


@gluon.jit
def _tanh(x):
    """tanh of float32 ``x`` by the hardware's approximation (``tanh.approx.f32``: one MUFU instruction; relative
    error at most 1.1e-5, measured on an H100 over [-20, 20], far below the bf16 rounding of the scores it caps).
    The Triton kernels' `flash_fwd._tanh` (exp2 and a division: two MUFU instructions and a division per score)
    differs from it by about as much, so a forward and a backward of different kernel families recompute slightly
    different probabilities."""
    return gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def _cap(qk, softcap_scale, SOFTCAP: gl.constexpr):
    """The logit softcap of raw scores (SOFTCAP): q.k -> tanh(q.k * softcap_scale), which the one multiplication by
    qk_scale = softcap * log2(e) that follows turns into the capped score in base 2; without SOFTCAP, q.k."""
    if SOFTCAP:
        qk = _tanh(qk * softcap_scale)
    return qk


@gluon.jit
def _softmax_keep(qk, m_i, l_i, keep, qk_scale):
    """Online softmax of one tile of raw scores where only ``keep`` (broadcast to the tile) is visible."""
    sc = gl.where(keep, qk * qk_scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(sc, 1))
    # a row with nothing visible yet keeps m = -inf: subtract 0 instead, exp2(-inf) = 0
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(sc - m_use[:, None])
    alpha = gl.exp2(m_i - m_use)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, m_new, alpha, l_i


@gluon.jit
def _softmax(qk, m_i, l_i, offs_m, start_n, Sk, lo, hi, qk_scale, s_layout: gl.constexpr, MASKED: gl.constexpr,
             HAS_LO: gl.constexpr, HAS_HI: gl.constexpr, BLOCK_N: gl.constexpr, softcap_scale=0.0,
             SOFTCAP: gl.constexpr = False):
    """Online softmax of one tile of raw scores: (p, new max, alpha = rescale of the old state, new sum); SOFTCAP
    caps the scores first (`_cap`)."""
    qk = _cap(qk, softcap_scale, SOFTCAP)
    if MASKED:
        cols = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        diff = cols[None, :] - offs_m[:, None]
        keep = cols[None, :] < Sk
        if HAS_LO:
            keep = keep & (diff >= lo)
        if HAS_HI:
            keep = keep & (diff <= hi)
        p, m_new, alpha, l_i = _softmax_keep(qk, m_i, l_i, keep, qk_scale)
    else:
        m_new = gl.maximum(m_i, gl.max(qk, 1) * qk_scale)
        p = gl.exp2(qk * qk_scale - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, 1)
    return p, m_new, alpha, l_i


@gluon.jit
def _scores(q, k_smem, k_ready, k_empty, s, ph, zero, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr):
    """Raw scores Q K^T of the key tile in ring slot ``s`` (phase ``ph``); the slot's K is released after."""
    k_buf = k_smem.index(s).reshape([BLOCK_N, BLOCK_D])
    mbarrier.wait(k_ready.index(s), ph)
    qk = warpgroup_mma(q, k_buf.permute((1, 0)), zero, use_acc=False, is_async=True)
    qk, _, _ = warpgroup_mma_wait(0, deps=(qk, q, k_buf))
    mbarrier.arrive(k_empty.index(s), count=1)
    return qk


@gluon.jit
def _pv(acc, p_op, v_smem, v_ready, v_empty, s, ph, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr):
    """acc += P V with the V tile of ring slot ``s`` (phase ``ph``); the slot's V is released after."""
    v_buf = v_smem.index(s).reshape([BLOCK_N, BLOCK_D])
    mbarrier.wait(v_ready.index(s), ph)
    acc = warpgroup_mma(p_op, v_buf, acc, is_async=True)
    acc, _, _ = warpgroup_mma_wait(0, deps=(acc, p_op, v_buf))
    mbarrier.arrive(v_empty.index(s), count=1)
    return acc


@gluon.jit
def _v_slot(i, s, ph, STAGES: gl.constexpr, V_STAGES: gl.constexpr):
    """Ring slot and phase of the i-th tile's V, given its K slot ``s`` and phase ``ph`` (the same ones where both
    rings have STAGES slots)."""
    if V_STAGES == STAGES:
        sv = s
        phv = ph
    else:
        sv = i % V_STAGES
        phv = (i // V_STAGES) & 1
    return sv, phv


@gluon.jit
def _rescale_pack(acc, alpha, p, p_layout: gl.constexpr, dtype: gl.constexpr):
    """The accumulator rescaled by alpha, and P in the input dtype as the register operand of the PV wgmma."""
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout))[:, None]
    return acc, gl.convert_layout(p.to(dtype), p_layout)


@gluon.jit
def _consume_run(acc, l_i, m_i, i, q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, offs_m, start, end,
                 Sk, lo, hi, qk_scale,
                 s_layout: gl.constexpr, p_layout: gl.constexpr, MASKED: gl.constexpr,
                 HAS_LO: gl.constexpr, HAS_HI: gl.constexpr,
                 BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, STAGES: gl.constexpr, V_STAGES: gl.constexpr,
                 softcap_scale=0.0, SOFTCAP: gl.constexpr = False):
    """Key tiles [start, end) for one warpgroup's 64 rows, one tile after the other; ``i`` counts tiles across
    runs (it selects the ring slots and the barrier phases, in the producer's order: K in a ring of STAGES slots,
    V in one of V_STAGES). SOFTCAP: the logit softcap (`_cap`)."""
    zero = gl.zeros([WG_ROWS, BLOCK_N], gl.float32, layout=s_layout)
    for start_n in range(start, end, BLOCK_N):
        s = i % STAGES
        ph = (i // STAGES) & 1
        qk = _scores(q, k_smem, k_ready, k_empty, s, ph, zero, BLOCK_N, BLOCK_D)
        p, m_i, alpha, l_i = _softmax(qk, m_i, l_i, offs_m, start_n, Sk, lo, hi, qk_scale, s_layout, MASKED,
                                      HAS_LO, HAS_HI, BLOCK_N, softcap_scale, SOFTCAP)
        acc, p_op = _rescale_pack(acc, alpha, p, p_layout, k_smem.dtype)
        sv, phv = _v_slot(i, s, ph, STAGES, V_STAGES)
        acc = _pv(acc, p_op, v_smem, v_ready, v_empty, sv, phv, BLOCK_N, BLOCK_D)
        i += 1
    return acc, l_i, m_i, i


@gluon.jit
def _consume_run_pipelined(acc, l_i, m_i, i, q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, start, end,
                           qk_scale, s_layout: gl.constexpr, p_layout: gl.constexpr,
                           BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, STAGES: gl.constexpr,
                           V_STAGES: gl.constexpr, q_free=None, release=False, RELEASE_Q: gl.constexpr = False,
                           softcap_scale=0.0, SOFTCAP: gl.constexpr = False):
    """The unmasked run with FlashAttention-3's intra-warpgroup overlap: the scores of tile j are issued, then
    P(j-1) V(j-1), and the softmax of tile j runs while P(j-1) V(j-1) is still on the tensor cores. Costs a
    second score tile and the bf16 P(j-1) in registers. Rings as `_consume_run`'s. RELEASE_Q (the persistent block-sparse forward): where
    ``release``, arrive on the barrier ``q_free`` once the run's last scores are done, its last softmax and P V
    still to come, so that the next work item's Q loads meanwhile. SOFTCAP: the logit softcap (`_cap`)."""
    zero = gl.zeros([WG_ROWS, BLOCK_N], gl.float32, layout=s_layout)
    if start < end:
        # -- first tile: scores and softmax, its P V is issued in the next iteration --
        s = i % STAGES
        ph = (i // STAGES) & 1
        qk = _scores(q, k_smem, k_ready, k_empty, s, ph, zero, BLOCK_N, BLOCK_D)
        if RELEASE_Q:  # noqa: SIM102 (a compile-time branch around a run-time one)
            if release & (start + BLOCK_N >= end):
                mbarrier.arrive(q_free, count=1)
        p, m_i, alpha, l_i = _softmax(qk, m_i, l_i, m_i, 0, 0, 0, 0, qk_scale, s_layout, False, False, False, BLOCK_N,
                                      softcap_scale, SOFTCAP)
        acc, p_op = _rescale_pack(acc, alpha, p, p_layout, k_smem.dtype)
        for _tile in range(start + BLOCK_N, end, BLOCK_N):
            sv_prev, phv_prev = _v_slot(i, s, ph, STAGES, V_STAGES)
            i += 1
            s = i % STAGES
            ph = (i // STAGES) & 1
            k_buf = k_smem.index(s).reshape([BLOCK_N, BLOCK_D])
            v_prev = v_smem.index(sv_prev).reshape([BLOCK_N, BLOCK_D])
            mbarrier.wait(k_ready.index(s), ph)
            qk = warpgroup_mma(q, k_buf.permute((1, 0)), zero, use_acc=False, is_async=True)
            mbarrier.wait(v_ready.index(sv_prev), phv_prev)
            acc = warpgroup_mma(p_op, v_prev, acc, is_async=True)
            # scores of tile j done (groups retire in order); P(j-1) V(j-1) may still run
            qk, _, _ = warpgroup_mma_wait(1, deps=(qk, q, k_buf))
            mbarrier.arrive(k_empty.index(s), count=1)
            if RELEASE_Q:  # noqa: SIM102 (a compile-time branch around a run-time one)
                if release & (_tile + BLOCK_N >= end):
                    mbarrier.arrive(q_free, count=1)
            p, m_i, alpha, l_i = _softmax(qk, m_i, l_i, m_i, 0, 0, 0, 0, qk_scale, s_layout, False, False, False,
                                          BLOCK_N, softcap_scale, SOFTCAP)
            acc, _, _ = warpgroup_mma_wait(0, deps=(acc, p_op, v_prev))
            mbarrier.arrive(v_empty.index(sv_prev), count=1)
            acc, p_op = _rescale_pack(acc, alpha, p, p_layout, k_smem.dtype)
        # -- P V of the last tile --
        sv, phv = _v_slot(i, s, ph, STAGES, V_STAGES)
        acc = _pv(acc, p_op, v_smem, v_ready, v_empty, sv, phv, BLOCK_N, BLOCK_D)
        i += 1
    return acc, l_i, m_i, i


@gluon.jit
def _consumer(q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, O, LSE,
              stride_ob, stride_oh, stride_om, stride_od,
              Sq, Sk, Hq, GROUP, lo, hi, qk_scale, softcap_scale, WG: gl.constexpr,
              HAS_LO: gl.constexpr, HAS_HI: gl.constexpr, LONGEST_FIRST: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, HEAD_DIM: gl.constexpr,
              STAGES: gl.constexpr, PIPE: gl.constexpr, SOFTCAP: gl.constexpr):
    """One warpgroup: 64 query rows against the CTA's key tiles; writes their output and lse."""
    s_layout: gl.constexpr = wgmma_layout(BLOCK_N)
    o_layout: gl.constexpr = wgmma_layout(BLOCK_D)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)

    off_b, off_h, off_kvh, start_m = _program(Sq, Hq, GROUP, LONGEST_FIRST, BLOCK_M)
    row_last = gl.minimum(start_m + BLOCK_M, Sq) - 1
    # every warpgroup walks the CTA's runs (the producer loads them once for both); its own rows are masked
    k_lo, full_lo, full_hi, k_end = _tile_ranges(start_m, row_last, Sk, lo, hi, HAS_LO, HAS_HI, BLOCK_N)
    my_start = start_m + WG * WG_ROWS
    offs_m = my_start + gl.arange(0, WG_ROWS, layout=row_s)

    m_i = gl.full([WG_ROWS], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([WG_ROWS], gl.float32, layout=row_s)
    acc = gl.zeros([WG_ROWS, BLOCK_D], gl.float32, layout=o_layout)
    q = q_smem.index(WG).reshape([WG_ROWS, BLOCK_D])
    mbarrier.wait(q_bar.index(WG), 0)
    i = 0
    acc, l_i, m_i, i = _consume_run(acc, l_i, m_i, i, q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, offs_m,
                                    k_lo, full_lo, Sk, lo, hi, qk_scale, s_layout, p_layout, True,
                                    HAS_LO, HAS_HI, BLOCK_N, BLOCK_D, STAGES, STAGES, softcap_scale, SOFTCAP)
    if PIPE:
        acc, l_i, m_i, i = _consume_run_pipelined(acc, l_i, m_i, i, q, k_smem, v_smem, k_ready, k_empty, v_ready,
                                                  v_empty, full_lo, full_hi, qk_scale, s_layout, p_layout,
                                                  BLOCK_N, BLOCK_D, STAGES, STAGES, softcap_scale=softcap_scale,
                                                  SOFTCAP=SOFTCAP)
    else:
        acc, l_i, m_i, i = _consume_run(acc, l_i, m_i, i, q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty,
                                        offs_m, full_lo, full_hi, Sk, lo, hi, qk_scale, s_layout, p_layout, False,
                                        HAS_LO, HAS_HI, BLOCK_N, BLOCK_D, STAGES, STAGES, softcap_scale, SOFTCAP)
    acc, l_i, m_i, i = _consume_run(acc, l_i, m_i, i, q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, offs_m,
                                    full_hi, k_end, Sk, lo, hi, qk_scale, s_layout, p_layout, True,
                                    HAS_LO, HAS_HI, BLOCK_N, BLOCK_D, STAGES, STAGES, softcap_scale, SOFTCAP)

    _epilogue(acc, l_i, m_i, O, LSE, stride_ob, stride_oh, stride_om, stride_od, off_b, off_h, Hq, Sq, my_start,
              offs_m, o_layout, HEAD_DIM, BLOCK_D)


@gluon.jit
def _store_lse(l_i, m_i, LSE, off_b, off_h, Hq, Sq, offs_m, o_layout: gl.constexpr):
    """The lse of one warpgroup's 64 rows ``offs_m`` (natural log; -inf where no key was seen, l = 0) into LSE;
    returns the rows' softmax sums in the accumulator's row layout, 1 where l = 0 (so the output is 0 there)."""
    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    lse = gl.where(empty, float("-inf"), (m_i + gl.log2(l_safe)) * 0.6931471805599453)
    pid_bh = off_b * Hq + off_h
    gl.store(LSE + pid_bh.to(gl.int64) * Sq + offs_m, lse, mask=offs_m < Sq)
    return gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout))


@gluon.jit
def _epilogue(acc, l_i, m_i, O, LSE, stride_ob, stride_oh, stride_om, stride_od, off_b, off_h, Hq, Sq, my_start,
              offs_m, o_layout: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_D: gl.constexpr):
    """Output and lse of one warpgroup's 64 rows (``offs_m``, starting at ``my_start``): rows that saw no key have
    l = 0 -> output 0, lse -inf; the lse in natural log."""
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    out = acc / _store_lse(l_i, m_i, LSE, off_b, off_h, Hq, Sq, offs_m, o_layout)[:, None]
    offs_mo = my_start + gl.arange(0, WG_ROWS, layout=row_o)
    offs_d = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, o_layout))
    o_ptrs = (O + off_b.to(gl.int64) * stride_ob + off_h.to(gl.int64) * stride_oh
              + offs_mo[:, None].to(gl.int64) * stride_om + offs_d[None, :] * stride_od)
    o_mask = (offs_mo[:, None] < Sq) & (offs_d[None, :] < HEAD_DIM)
    gl.store(o_ptrs, out.to(O.dtype.element_ty), mask=o_mask)


@gluon.jit
def _shared(desc_q, desc_k, desc_v, STAGES: gl.constexpr, V_STAGES: gl.constexpr, O_TILES: gl.constexpr):
    """The CTA's shared memory: Q of both consumers (then, with O_TILES=1, an output tile of Q's shape for each:
    index ``2 + consumer``), a ring of STAGES K slots and one of V_STAGES V slots, and their mbarriers,
    initialised (a slot's "empty" barrier completes when both consumers released it)."""
    dtype: gl.constexpr = desc_q.dtype
    q_smem = gl.allocate_shared_memory(dtype, [(1 + O_TILES) * NUM_CONSUMERS] + desc_q.block_type.shape,
                                       desc_q.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES] + desc_k.block_type.shape, desc_k.layout)
    v_smem = gl.allocate_shared_memory(dtype, [V_STAGES] + desc_v.block_type.shape, desc_v.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [NUM_CONSUMERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], mbarrier.MBarrierLayout())
    for w in gl.static_range(NUM_CONSUMERS):
        mbarrier.init(q_bar.index(w), count=1)
    for s in gl.static_range(max(STAGES, V_STAGES)):
        if s < STAGES:
            mbarrier.init(k_ready.index(s), count=1)
        if s < V_STAGES:
            mbarrier.init(v_ready.index(s), count=1)
        if s < STAGES:
            mbarrier.init(k_empty.index(s), count=NUM_CONSUMERS)
        if s < V_STAGES:
            mbarrier.init(v_empty.index(s), count=NUM_CONSUMERS)
    return q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty


@gluon.jit(do_not_specialize=["Sq", "Sk", "lo", "hi"])
def attn_fwd_ws_kernel(
    desc_q, desc_k, desc_v, O, LSE,
    stride_ob, stride_oh, stride_om, stride_od,
    Hq, Sq, Sk, GROUP, lo, hi, qk_scale, softcap_scale,
    HEAD_DIM: gl.constexpr, BLOCK_D: gl.constexpr,
    HAS_LO: gl.constexpr, HAS_HI: gl.constexpr, LONGEST_FIRST: gl.constexpr,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PIPE: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, SOFTCAP: gl.constexpr = False,
):
    """Grid: (B * Hq, cdiv(Sq, 128)) with LONGEST_FIRST, else (cdiv(Sq, 128), B * Hq); launched with num_warps=4
    (consumer 0) plus the workers' 4 + 1 warps. desc_q has block (1, 1, 64, BLOCK_D), desc_k / desc_v
    (1, 1, BLOCK_N, BLOCK_D); O is written through pointers with its own strides, LSE is (B, Hq, Sq) float32.
    SOFTCAP caps the scores (``qk_scale`` = softcap * log2(e), ``softcap_scale`` = scale / softcap, as the Triton
    forward's); without it qk_scale = scale * log2(e) and softcap_scale is unused."""
    BLOCK_M: gl.constexpr = WG_ROWS * NUM_CONSUMERS
    q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty = _shared(desc_q, desc_k, desc_v, STAGES, STAGES, 0)

    gl.warp_specialize([
        (_consumer, (q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, O, LSE,
                     stride_ob, stride_oh, stride_om, stride_od, Sq, Sk, Hq, GROUP, lo, hi, qk_scale, softcap_scale,
                     0, HAS_LO, HAS_HI, LONGEST_FIRST, BLOCK_M, BLOCK_N, BLOCK_D, HEAD_DIM, STAGES, PIPE, SOFTCAP)),
        (_consumer, (q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, O, LSE,
                     stride_ob, stride_oh, stride_om, stride_od, Sq, Sk, Hq, GROUP, lo, hi, qk_scale, softcap_scale,
                     1, HAS_LO, HAS_HI, LONGEST_FIRST, BLOCK_M, BLOCK_N, BLOCK_D, HEAD_DIM, STAGES, PIPE, SOFTCAP)),
        (_producer, (desc_q, desc_k, desc_v, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
                     Sq, Sk, Hq, GROUP, lo, hi, HAS_LO, HAS_HI, LONGEST_FIRST, BLOCK_M, BLOCK_N, BLOCK_D, STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
