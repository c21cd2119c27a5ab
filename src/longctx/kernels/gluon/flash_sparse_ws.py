"""Block-sparse FlashAttention for Hopper, warp-specialised, in Gluon: the kernels of `flash_fwd_ws` and
`flash_bwd_ws` walking the block lists of a `BlockMask` instead of a band's tile ranges.

The dense warp-specialised kernels' partitions, barriers and tile steps are reused as they are (`_scores`,
`_softmax`, `_pv`, `_consume_run_pipelined` and `_epilogue` of the forward; `_tile` of the backward, whose
``MASKED=2`` takes a visibility tile from here). What changes is which tiles the producer loads and the consumers
consume, and the element mask of partial blocks (`flash_sparse._visible`, the Triton kernels' own rule, called
from Gluon):

- forward: one CTA = 128 query rows of one query head (two consumer warpgroups of 64 rows); the producer loads
  the K/V sub-tiles of the query block's full kv blocks, then of its partial ones. Full blocks run the
  pipelined loop without any mask (the ragged end of Sk aside); partial blocks apply the mask.
- backward: one CTA = 128 keys of one kv head; for every query head of the GQA group, the producer streams the
  query tiles of the kv block's full query blocks, then of its partial ones (the transposed lists); dQ is added
  by the copy engine's bulk reduction, as in `flash_bwd_ws` (so not bitwise repeatable: ``deterministic=True``
  keeps the Triton kernels of `flash_sparse`).

Persistent: one CTA per SM takes work items (the CTAs above) by an atomic ticket, in the launcher's order
(`launchers.sparse._schedule`: heads in order, the longest items first within a head); its producer takes the next ticket once the current item's loads are issued and
posts it to the consumers, so the next item's K/V (forward) or Q/dO (backward) loads while this one ends.

Both need the mask's block size to be a multiple of 128 (a CTA's rows / keys lie in one mask block). The lists,
MASK_KIND and the per-token tensors are those of `flash_sparse` (see its docstring); with MASK_KIND 3 (intervals)
each CTA reads its own side's intervals once and the tiles read nothing per token.

The forward's output leaves through the warpgroup's Q buffer and the copy engine (`_epilogue_tma`); the backward's
dK / dV through its dQ tile and the copy engine (`_store_dkdv_tma`) where its query tiles have 64 rows.

Logit softcapping (SOFTCAP) as in the dense kernels (`flash_fwd_ws`, `flash_bwd_ws`): the scores capped before the
element mask; with SOFTCAP off (the default) the compiled code has no trace of it.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from longctx.kernels.gluon import flash_bwd_ws as bws
from longctx.kernels.gluon import flash_fwd_ws as fws
from longctx.kernels.triton.flash_sparse import _visible

# fmt: off

WG_ROWS = fws.WG_ROWS
NUM_CONSUMERS = fws.NUM_CONSUMERS
CTA_ROWS = gl.constexpr(128)  # rows (forward) / keys (backward) of one CTA
BIG = gl.constexpr(1 << 30)  # an unbounded side of a MASK_KIND 3 interval (`block_sparse.BIG`)


# Lengths, window bounds and the mask tables' strides change with every sequence length and document packing:
# runtime integers, never specialised (Triton would compile another kernel whenever one became a multiple of 16).
_RUNTIME_INTS = [
    "Sq", "Sk", "lo", "hi", "n_items", "n_tiles", "stride_nb", "stride_nh", "stride_ib", "stride_ih",
    "stride_tb", "stride_th", "stride_tq", "kv_global", "q_global",
]


@gluon.jit
def _list_ptrs(NUM, IDX, FULL_NUM, FULL_IDX, stride_nb, stride_nh, stride_ib, stride_ih, stride_iq, off_b, off_h,
               blk):
    """(full count pointer, full list row, partial count pointer, partial list row) of mask block ``blk`` of
    (batch, head)."""
    nb = off_b.to(gl.int64) * stride_nb + off_h.to(gl.int64) * stride_nh + blk
    ib = off_b.to(gl.int64) * stride_ib + off_h.to(gl.int64) * stride_ih + blk.to(gl.int64) * stride_iq
    return FULL_NUM + nb, FULL_IDX + ib, NUM + nb, IDX + ib


@gluon.jit
def _lists(NUM, IDX, FULL_NUM, FULL_IDX, stride_nb, stride_nh, stride_ib, stride_ih, stride_iq, off_b, off_h, blk):
    """(full count, full list row, partial count, partial list row) of mask block ``blk`` of (batch, head)."""
    full_n, FULL_row, part_n, PART_row = _list_ptrs(NUM, IDX, FULL_NUM, FULL_IDX, stride_nb, stride_nh, stride_ib,
                                                    stride_ih, stride_iq, off_b, off_h, blk)
    return gl.load(full_n), FULL_row, gl.load(part_n), PART_row


@gluon.jit
def _tokens(DOC_b, POS_b, idx, n, other_doc, MASK_KIND: gl.constexpr, HAS_DOC: gl.constexpr,
            PER_TILE: gl.constexpr):
    """(doc, pos) of the tokens ``idx`` (one side of `_visible`; zeros where MASK_KIND reads none). PER_TILE: the
    side read for every tile, which MASK_KIND 3 does not read (its other side's intervals decide alone: the
    unbounded interval [-BIG, BIG] here). Tokens past ``n`` read ``other_doc`` and position 0."""
    d = gl.zeros_like(idx)
    p = gl.zeros_like(idx)
    if MASK_KIND == 3 and PER_TILE:
        d = gl.full_like(idx, -BIG)
        p = gl.full_like(idx, BIG)
    elif MASK_KIND == 1 or MASK_KIND == 3:
        if HAS_DOC:
            d = gl.load(DOC_b + idx, mask=idx < n, other=other_doc)
        p = gl.load(POS_b + idx, mask=idx < n, other=0)
    return d, p


# -- forward --------------------------------------------------------------------------------------------------


@gluon.jit
def _entry(t, SCHED):
    """Work item ``t``'s entry ``tile + n_tiles * (b * H + h)``: the ``t``-th entry of the launcher's schedule
    (`launchers.sparse._schedule`). A head's tiles are neighbours in it: the CTAs in flight share one head's K/V
    (forward) or Q/dO (backward) in L2."""
    e = gl.load(SCHED + t)
    return e


@gluon.jit
def _decode(e, n_tiles, H):
    """(batch, head, first row / key) of work item entry ``e``."""
    pid_bh = e // n_tiles
    return pid_bh // H, pid_bh % H, (e % n_tiles) * CTA_ROWS


@gluon.jit
def _fwd_counts(e, KV_NUM, FULL_NUM, stride_nb, stride_nh, n_tiles, Hq, MASK_BS: gl.constexpr):
    """(full, partial) kv block counts of forward work item entry ``e`` (its query block's lists)."""
    off_b, off_h, start_m = _decode(e, n_tiles, Hq)
    nb = off_b.to(gl.int64) * stride_nb + off_h.to(gl.int64) * stride_nh + start_m // MASK_BS
    return gl.load(FULL_NUM + nb), gl.load(KV_NUM + nb)


@gluon.jit
def _take_ticket(CNT, nprog):
    """Persistent kernels, producer warp: the next work item of this CTA, ``nprog`` + the number of tickets taken so
    far by all CTAs (one atomic by lane 0, broadcast to the warp's lanes). Items are handed out in order, so the
    CTAs in flight work on neighbouring items (L2) and each takes the next one when it is free (balance)."""
    lanes = gl.arange(0, 32, layout=gl.BlockedLayout([1], [32], [1], [0]))
    got = gl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b32 r; mov.b32 r, 0; setp.eq.s32 p, $2, 0; @p atom.global.add.u32 r, [$1], 1; "
        "shfl.sync.idx.b32 $0, r, 0, 31, 0xffffffff; }",
        "=r,l,r", [CNT + lanes * 0, lanes], dtype=gl.int32, is_pure=False, pack=1)
    return nprog + gl.max(got, 0)


@gluon.jit
def _post_ticket(tickets, tk_ready, tk_empty, n, t, e, n_full, n_part):
    """Producer warp: the CTA's item ``n + 1`` (item 0 is the program id) into the two-slot ring, for both
    consumers: its ticket ``t`` and, where ``t`` is an item, its entry ``e`` (`_entry`) and (forward) its full and
    partial block counts, so that the consumers start it without a global load (lanes 0-3 of the slot)."""
    s = n % 2
    mbarrier.wait(tk_empty.index(s), ((n // 2) & 1) ^ 1)
    layout: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, 1], [1, 0])
    lane = gl.arange(0, 32, layout=gl.SliceLayout(0, layout))[None, :]
    vals = gl.where(lane == 0, t, gl.where(lane == 1, e, gl.where(lane == 2, n_full,
                                                               gl.where(lane == 3, n_part, 0))))
    tickets.index(s).store(vals)
    # the lanes' stores are ordered before the (one-thread) arrive's release
    gl.inline_asm_elementwise("bar.warp.sync 0xffffffff; mov.b32 $0, $1;", "=r,r", [vals], dtype=gl.int32,
                              is_pure=False, pack=1)
    mbarrier.arrive(tk_ready.index(s), count=1)


@gluon.jit
def _read_ticket(tickets, tk_ready, tk_empty, n):
    """Consumer warpgroup: (ticket, entry, full count, partial count) of the CTA's item ``n + 1`` (`_post_ticket`)."""
    s = n % 2
    mbarrier.wait(tk_ready.index(s), (n // 2) & 1)
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [32, 1], [4, 1], [1, 0])  # every thread reads entries 0-3
    got = tickets.index(s).slice(0, 4, dim=1).load(layout)
    lane = gl.arange(0, 4, layout=gl.SliceLayout(0, layout))[None, :]
    t = gl.sum(gl.sum(gl.where(lane == 0, got, 0), 1), 0)
    e = gl.sum(gl.sum(gl.where(lane == 1, got, 0), 1), 0)
    n_full = gl.sum(gl.sum(gl.where(lane == 2, got, 0), 1), 0)
    n_part = gl.sum(gl.sum(gl.where(lane == 3, got, 0), 1), 0)
    mbarrier.arrive(tk_empty.index(s), count=1)
    return t, e, n_full, n_part


@gluon.jit
def _next_item(CNT, nprog, tickets, tk_ready, tk_empty, n, n_items, SCHED, KV_NUM, FULL_NUM, stride_nb, stride_nh,
               n_tiles, H, MASK_BS: gl.constexpr, COUNTS: gl.constexpr):
    """Producer warp, once it has issued every load of the CTA's ``n``-th item: the next item as (ticket, entry,
    full count, partial count), posted to the consumers (the counts with COUNTS, forward; else 0). Taken this late,
    so that a CTA reserves its next item only when its current one is nearly done: taken as an item started, a CTA
    on a long item held the next long one while others went idle (docs/performance.md)."""
    n_full = n_items * 0
    n_part = n_items * 0
    t = _take_ticket(CNT, nprog)
    e = t
    if t < n_items:
        e = _entry(t, SCHED)
        if COUNTS:
            n_full, n_part = _fwd_counts(e, KV_NUM, FULL_NUM, stride_nb, stride_nh, n_tiles, H, MASK_BS)
    _post_ticket(tickets, tk_ready, tk_empty, n, t, e, n_full, n_part)
    return t, e, n_full, n_part


@gluon.jit
def _persistent_shared(NUM_Q: gl.constexpr, KV_EMPTY: gl.constexpr):
    """The persistent kernels' own shared memory: the ticket ring (two slots, each read by both consumers) and
    ``NUM_Q`` "Q free" barriers (forward, one per consumer) or one "K/V free" barrier released by both consumers
    (KV_EMPTY, backward)."""
    tickets = gl.allocate_shared_memory(gl.int32, [2, 1, 32], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    tk_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    tk_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [NUM_Q, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(2):
        mbarrier.init(tk_ready.index(s), count=1)
        mbarrier.init(tk_empty.index(s), count=NUM_CONSUMERS)
    for s in gl.static_range(NUM_Q):
        mbarrier.init(free.index(s), count=NUM_CONSUMERS if KV_EMPTY else 1)
    return tickets, tk_ready, tk_empty, free


# the TMA store is `async_store` from Triton 3.7 on, `async_copy_shared_to_global` in 3.6; a shared tile's
# reinterpretation is `reinterpret` in 3.9, `_reinterpret` in 3.6
_tma_store = getattr(bws.tma, "async_store", None) or bws.tma.async_copy_shared_to_global
_REINTERPRET_PUBLIC = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))


@gluon.jit
def _store_dkdv_tma(dk, dv, desc_dk, desc_dv, stage, off_b, off_kvh, my_n, sm_scale, BLOCK_D: gl.constexpr):
    """Persistent backward's epilogue of one warpgroup: dK (with the softmax scale) and dV through its float32 dQ
    tile (64 x BLOCK_D/2 float32: as many bytes as 64 x BLOCK_D of dK) and the copy engine, one after the other.
    Stores from registers would keep 2 x 64 pointers per thread live in the item loop (the D=128 backward then
    spills ~600 bytes); the copy engine clips rows past Sk. The second copy is waited for where the tile is next
    written (the next item's first dQ tile, or the kernel's end)."""
    if _REINTERPRET_PUBLIC:
        tile = stage.reinterpret(desc_dk.dtype, desc_dk.block_type.shape, desc_dk.layout)
    else:
        tile = stage._reinterpret(desc_dk.dtype, desc_dk.block_type.shape, desc_dk.layout)
    bws.tma.store_wait(0)  # the last dQ reduction has read the tile
    tile.reshape([WG_ROWS, BLOCK_D]).store((dk * sm_scale).to(desc_dk.dtype))
    bws.fence_async_shared()
    _tma_store(desc_dk, [off_b, off_kvh, my_n, 0], tile)
    bws.tma.store_wait(0)
    tile.reshape([WG_ROWS, BLOCK_D]).store(dv.to(desc_dv.dtype))
    bws.fence_async_shared()
    _tma_store(desc_dv, [off_b, off_kvh, my_n, 0], tile)


@gluon.jit
def _epilogue_tma(acc, l_i, m_i, LSE, desc_o, buf, q_free_w, off_b, off_h, Hq, Sq, my_start, offs_m,
                  o_layout: gl.constexpr):
    """`flash_fwd_ws._epilogue` through shared memory: the output tile goes into the warpgroup's Q buffer (its
    last scores are done) and leaves by the copy engine (which clips rows past Sq), so that 64 x D values cost
    one shared-memory pass instead of 32 strided 4-byte global stores per thread (the register layout of a wgmma
    accumulator). The buffer is freed for the next item's Q once the copy has read it."""
    out = acc * (1.0 / fws._store_lse(l_i, m_i, LSE, off_b, off_h, Hq, Sq, offs_m, o_layout))[:, None]
    buf.reshape([WG_ROWS, desc_o.block_type.shape[3]]).store(out.to(desc_o.dtype))
    bws.fence_async_shared()
    _tma_store(desc_o, [off_b, off_h, my_start, 0], buf)
    bws.tma.store_wait(0)  # the copy has read the buffer
    mbarrier.arrive(q_free_w, count=1)


@gluon.jit
def _fwd_load_list(desc_k, desc_v, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, off_b, off_kvh, IDX_row,
                   n_tiles, i, MASK_BS: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    SUB: gl.constexpr = MASK_BS // BLOCK_N
    for j in range(n_tiles):
        start_n = gl.load(IDX_row + j // SUB) * MASK_BS + (j % SUB) * BLOCK_N
        s = i % STAGES
        ph = (i // STAGES) & 1
        mbarrier.wait(k_empty.index(s), ph ^ 1)
        mbarrier.expect(k_ready.index(s), desc_k.block_type.nbytes)
        fws._tma_load(desc_k, [off_b, off_kvh, start_n, 0], k_ready.index(s), k_smem.index(s))
        sv, phv = fws._v_slot(i, s, ph, STAGES, STAGES)
        mbarrier.wait(v_empty.index(sv), phv ^ 1)
        mbarrier.expect(v_ready.index(sv), desc_v.block_type.nbytes)
        fws._tma_load(desc_v, [off_b, off_kvh, start_n, 0], v_ready.index(sv), v_smem.index(sv))
        i += 1
    return i


@gluon.jit
def _fwd_producer(desc_q, desc_k, desc_v, q_smem, k_smem, v_smem, q_bar, q_free, k_ready, k_empty, v_ready, v_empty,
                  tickets, tk_ready, tk_empty, CNT,
                  KV_NUM, KV_IDX, FULL_NUM, FULL_IDX, stride_nb, stride_nh, stride_ib, stride_ih, stride_iq,
                  SCHED, n_items, n_tiles, Hq, GROUP, MASK_BS: gl.constexpr, BLOCK_N: gl.constexpr,
                  STAGES: gl.constexpr):
    """One warp, per work item until the tickets run out (`_next_item`): Q of both consumers (once they freed its
    buffer), then the K/V sub-tiles of the full kv blocks, then of the partial ones."""
    SUB: gl.constexpr = MASK_BS // BLOCK_N
    t = gl.program_id(0)
    nprog = gl.num_programs(0)
    e = _entry(t, SCHED)
    n_full, n_part = _fwd_counts(e, KV_NUM, FULL_NUM, stride_nb, stride_nh, n_tiles, Hq, MASK_BS)
    n = 0
    i = 0
    while t < n_items:
        off_b, off_h, start_m = _decode(e, n_tiles, Hq)
        off_kvh = off_h // GROUP
        _, FULL_row, _, PART_row = _list_ptrs(KV_NUM, KV_IDX, FULL_NUM, FULL_IDX, stride_nb, stride_nh, stride_ib,
                                              stride_ih, stride_iq, off_b, off_h, start_m // MASK_BS)
        for w in gl.static_range(NUM_CONSUMERS):
            mbarrier.wait(q_free.index(w), (n & 1) ^ 1)
            bar = q_bar.index(w)
            mbarrier.expect(bar, desc_q.block_type.nbytes)
            fws._tma_load(desc_q, [off_b, off_h, start_m + w * WG_ROWS, 0], bar, q_smem.index(w))
        i = _fwd_load_list(desc_k, desc_v, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, off_b, off_kvh,
                           FULL_row, n_full * SUB, i, MASK_BS, BLOCK_N, STAGES)
        i = _fwd_load_list(desc_k, desc_v, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, off_b, off_kvh,
                           PART_row, n_part * SUB, i, MASK_BS, BLOCK_N, STAGES)
        t, e, n_full, n_part = _next_item(CNT, nprog, tickets, tk_ready, tk_empty, n, n_items, SCHED, KV_NUM,
                                          FULL_NUM, stride_nb, stride_nh, n_tiles, Hq, MASK_BS, True)
        n += 1


@gluon.jit
def _fwd_masked_run(acc, l_i, m_i, i, q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, offs_m, qd, qp,
                    IDX_row, n_tiles, qb, KDOC_b, KPOS_b, TILE_IDS_bh, stride_tq, TILES,
                    Sk, lo, hi, kv_global, q_global, qk_scale,
                    s_layout: gl.constexpr, p_layout: gl.constexpr, MASK_KIND: gl.constexpr, HAS_DOC: gl.constexpr,
                    HAS_GLOBAL: gl.constexpr, MASK_BS: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr,
                    STAGES: gl.constexpr, softcap_scale=0.0, SOFTCAP: gl.constexpr = False):
    """The listed sub-tiles with the element mask of MASK_KIND (0: the ragged end of Sk only); SOFTCAP caps the
    scores first (`flash_fwd_ws._cap`)."""
    SUB: gl.constexpr = MASK_BS // BLOCK_N
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    zero = gl.zeros([WG_ROWS, BLOCK_N], gl.float32, layout=s_layout)
    for j in range(n_tiles):
        kb = gl.load(IDX_row + j // SUB)
        cols = kb * MASK_BS + (j % SUB) * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_s)
        kd, kp = _tokens(KDOC_b, KPOS_b, cols, Sk, -2, MASK_KIND, HAS_DOC, True)
        keep = _visible(offs_m[:, None], cols[None, :], qd[:, None], kd[None, :], qp[:, None], kp[None, :], qb, kb,
                        TILE_IDS_bh, stride_tq, TILES, Sk, lo, hi, kv_global, q_global,
                        MASK_KIND, HAS_DOC, HAS_GLOBAL, MASK_BS)
        s = i % STAGES
        ph = (i // STAGES) & 1
        qk = fws._scores(q, k_smem, k_ready, k_empty, s, ph, zero, BLOCK_N, BLOCK_D)
        qk = fws._cap(qk, softcap_scale, SOFTCAP)
        p, m_i, alpha, l_i = fws._softmax_keep(qk, m_i, l_i, keep, qk_scale)
        acc, p_op = fws._rescale_pack(acc, alpha, p, p_layout, k_smem.dtype)
        sv, phv = fws._v_slot(i, s, ph, STAGES, STAGES)
        acc = fws._pv(acc, p_op, v_smem, v_ready, v_empty, sv, phv, BLOCK_N, BLOCK_D)
        i += 1
    return acc, l_i, m_i, i


@gluon.jit
def _fwd_item(e, n_full, n_part, n, i, q_smem, k_smem, v_smem, q_bar, q_free, k_ready, k_empty, v_ready, v_empty,
              desc_o, LSE,
              KV_NUM, KV_IDX, FULL_NUM, FULL_IDX, stride_nb, stride_nh, stride_ib, stride_ih, stride_iq,
              QDOC, KDOC, QPOS, KPOS, stride_qdoc, stride_kdoc, TILES, TILE_IDS, stride_tb, stride_th, stride_tq,
              n_tiles, Hq, Sq, Sk, lo, hi, kv_global, q_global, qk_scale, softcap_scale, WG: gl.constexpr,
              MASK_BS: gl.constexpr, MASK_KIND: gl.constexpr, HAS_DOC: gl.constexpr, HAS_GLOBAL: gl.constexpr,
              EVEN_SK: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, STAGES: gl.constexpr,
              PIPE: gl.constexpr, SOFTCAP: gl.constexpr):
    """Work item entry ``e`` (`_entry`) with ``n_full`` / ``n_part`` listed blocks, the CTA's ``n``-th, for one
    warpgroup: 64 query rows against the listed kv blocks; writes their output (through Q's buffer and the copy
    engine, `_epilogue_tma`, which then frees the buffer) and lse. ``i`` counts the K/V tiles consumed so far (ring
    slots and phases); returns it."""
    s_layout: gl.constexpr = fws.wgmma_layout(BLOCK_N)
    o_layout: gl.constexpr = fws.wgmma_layout(BLOCK_D)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    SUB: gl.constexpr = MASK_BS // BLOCK_N

    off_b, off_h, start_m = _decode(e, n_tiles, Hq)
    qb = start_m // MASK_BS
    _, FULL_row, _, PART_row = _list_ptrs(KV_NUM, KV_IDX, FULL_NUM, FULL_IDX, stride_nb, stride_nh, stride_ib,
                                          stride_ih, stride_iq, off_b, off_h, qb)
    my_start = start_m + WG * WG_ROWS
    offs_m = my_start + gl.arange(0, WG_ROWS, layout=row_s)
    qd, qp = _tokens(QDOC + off_b.to(gl.int64) * stride_qdoc, QPOS + off_b.to(gl.int64) * stride_qdoc, offs_m,
                     Sq, -1, MASK_KIND, HAS_DOC, False)
    TILE_IDS_bh = TILE_IDS + off_b.to(gl.int64) * stride_tb + off_h.to(gl.int64) * stride_th
    KDOC_b = KDOC + off_b.to(gl.int64) * stride_kdoc
    KPOS_b = KPOS + off_b.to(gl.int64) * stride_kdoc

    m_i = gl.full([WG_ROWS], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([WG_ROWS], gl.float32, layout=row_s)
    acc = gl.zeros([WG_ROWS, BLOCK_D], gl.float32, layout=o_layout)
    q = q_smem.index(WG).reshape([WG_ROWS, BLOCK_D])
    mbarrier.wait(q_bar.index(WG), n & 1)
    # -- full blocks: no element mask (the runs of the dense kernel only count tiles here) --
    if EVEN_SK:
        if PIPE:
            acc, l_i, m_i, i = fws._consume_run_pipelined(acc, l_i, m_i, i, q, k_smem, v_smem, k_ready, k_empty,
                                                          v_ready, v_empty, 0, n_full * SUB * BLOCK_N, qk_scale,
                                                          s_layout, p_layout, BLOCK_N, BLOCK_D, STAGES, STAGES,
                                                          softcap_scale=softcap_scale, SOFTCAP=SOFTCAP)
        else:
            acc, l_i, m_i, i = fws._consume_run(acc, l_i, m_i, i, q, k_smem, v_smem, k_ready, k_empty, v_ready,
                                                v_empty, offs_m, 0, n_full * SUB * BLOCK_N, Sk, 0, 0, qk_scale,
                                                s_layout, p_layout, False, False, False, BLOCK_N, BLOCK_D, STAGES,
                                                STAGES, softcap_scale, SOFTCAP)
    else:
        # the last kv block reaches past Sk: its keys there arrive as zeros and must be masked
        acc, l_i, m_i, i = _fwd_masked_run(acc, l_i, m_i, i, q, k_smem, v_smem, k_ready, k_empty, v_ready,
                                           v_empty, offs_m, qd, qp, FULL_row, n_full * SUB, qb, KDOC_b, KPOS_b,
                                           TILE_IDS_bh, stride_tq, TILES, Sk, lo, hi, kv_global, q_global,
                                           qk_scale, s_layout, p_layout, 0, False, False, MASK_BS, BLOCK_N,
                                           BLOCK_D, STAGES, softcap_scale, SOFTCAP)
    # -- partial blocks: the element mask --
    acc, l_i, m_i, i = _fwd_masked_run(acc, l_i, m_i, i, q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty,
                                       offs_m, qd, qp, PART_row, n_part * SUB, qb, KDOC_b, KPOS_b, TILE_IDS_bh,
                                       stride_tq, TILES, Sk, lo, hi, kv_global, q_global, qk_scale,
                                       s_layout, p_layout, MASK_KIND, HAS_DOC, HAS_GLOBAL, MASK_BS, BLOCK_N,
                                       BLOCK_D, STAGES, softcap_scale, SOFTCAP)
    # -- epilogue --
    _epilogue_tma(acc, l_i, m_i, LSE, desc_o, q_smem.index(WG), q_free.index(WG), off_b, off_h, Hq, Sq, my_start,
                  offs_m, o_layout)
    return i


@gluon.jit
def _fwd_consumer(q_smem, k_smem, v_smem, q_bar, q_free, k_ready, k_empty, v_ready, v_empty, tickets, tk_ready,
                  tk_empty, desc_o, LSE,
                  KV_NUM, KV_IDX, FULL_NUM, FULL_IDX, stride_nb, stride_nh, stride_ib, stride_ih, stride_iq,
                  QDOC, KDOC, QPOS, KPOS, stride_qdoc, stride_kdoc, TILES, TILE_IDS, stride_tb, stride_th, stride_tq,
                  SCHED, n_items, n_tiles, Hq, Sq, Sk, lo, hi, kv_global, q_global, qk_scale, softcap_scale,
                  WG: gl.constexpr, MASK_BS: gl.constexpr, MASK_KIND: gl.constexpr, HAS_DOC: gl.constexpr,
                  HAS_GLOBAL: gl.constexpr, EVEN_SK: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr,
                  STAGES: gl.constexpr, PIPE: gl.constexpr, SOFTCAP: gl.constexpr):
    """One warpgroup: its 64 rows of every item the producer hands out, until the tickets run out."""
    t = gl.program_id(0)
    e = _entry(t, SCHED)
    n_full, n_part = _fwd_counts(e, KV_NUM, FULL_NUM, stride_nb, stride_nh, n_tiles, Hq, MASK_BS)
    n = 0
    i = 0
    while t < n_items:
        i = _fwd_item(e, n_full, n_part, n, i, q_smem, k_smem, v_smem, q_bar, q_free, k_ready, k_empty, v_ready,
                      v_empty, desc_o, LSE,
                      KV_NUM, KV_IDX, FULL_NUM, FULL_IDX, stride_nb, stride_nh, stride_ib, stride_ih, stride_iq,
                      QDOC, KDOC, QPOS, KPOS, stride_qdoc, stride_kdoc, TILES, TILE_IDS, stride_tb, stride_th,
                      stride_tq, n_tiles, Hq, Sq, Sk, lo, hi, kv_global, q_global, qk_scale, softcap_scale, WG,
                      MASK_BS, MASK_KIND, HAS_DOC, HAS_GLOBAL, EVEN_SK, BLOCK_N, BLOCK_D, STAGES, PIPE, SOFTCAP)
        t, e, n_full, n_part = _read_ticket(tickets, tk_ready, tk_empty, n)
        n += 1


@gluon.jit(do_not_specialize=_RUNTIME_INTS + ["stride_iq"])
def sparse_fwd_ws_kernel(
    desc_q, desc_k, desc_v, desc_o, LSE,
    KV_NUM, KV_IDX, FULL_NUM, FULL_IDX, stride_nb, stride_nh, stride_ib, stride_ih, stride_iq,
    QDOC, KDOC, QPOS, KPOS, stride_qdoc, stride_kdoc, TILES, TILE_IDS, stride_tb, stride_th, stride_tq,
    SCHED, CNT, n_items, n_tiles, Hq, Sq, Sk, GROUP, lo, hi, kv_global, q_global, qk_scale, softcap_scale,
    BLOCK_D: gl.constexpr, MASK_BS: gl.constexpr, MASK_KIND: gl.constexpr,
    HAS_DOC: gl.constexpr, HAS_GLOBAL: gl.constexpr, EVEN_SK: gl.constexpr,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PIPE: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, SOFTCAP: gl.constexpr = False,
):
    """Grid: (at most one CTA per SM,), each taking work items ``tile + n_tiles * (b * Hq + h)`` (tiles of 128 query
    rows) in the order of SCHED by ticket from the zeroed int32 counter CNT; num_warps=4 (consumer 0) plus the
    workers' 4 + 1 warps (the next item's K/V loads while this one ends; its Q once the consumers release their
    buffer). Descriptors as `flash_fwd_ws.attn_fwd_ws_kernel`'s (desc_o: the output's, 64-row blocks); the mask
    arguments as `flash_sparse.sparse_fwd_kernel`'s; SOFTCAP, qk_scale and softcap_scale as the dense kernel's."""
    q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty = fws._shared(desc_q, desc_k, desc_v, STAGES,
                                                                                    STAGES, 0)
    tickets, tk_ready, tk_empty, q_free = _persistent_shared(NUM_CONSUMERS, False)

    gl.warp_specialize([
        (_fwd_consumer, (q_smem, k_smem, v_smem, q_bar, q_free, k_ready, k_empty, v_ready, v_empty, tickets,
                         tk_ready, tk_empty, desc_o, LSE,
                         KV_NUM, KV_IDX, FULL_NUM, FULL_IDX, stride_nb, stride_nh, stride_ib, stride_ih, stride_iq,
                         QDOC, KDOC, QPOS, KPOS, stride_qdoc, stride_kdoc, TILES, TILE_IDS, stride_tb, stride_th,
                         stride_tq, SCHED, n_items, n_tiles, Hq, Sq, Sk, lo, hi, kv_global, q_global, qk_scale,
                         softcap_scale, 0, MASK_BS, MASK_KIND, HAS_DOC, HAS_GLOBAL, EVEN_SK, BLOCK_N, BLOCK_D, STAGES,
                         PIPE, SOFTCAP)),
        (_fwd_consumer, (q_smem, k_smem, v_smem, q_bar, q_free, k_ready, k_empty, v_ready, v_empty, tickets,
                         tk_ready, tk_empty, desc_o, LSE,
                         KV_NUM, KV_IDX, FULL_NUM, FULL_IDX, stride_nb, stride_nh, stride_ib, stride_ih, stride_iq,
                         QDOC, KDOC, QPOS, KPOS, stride_qdoc, stride_kdoc, TILES, TILE_IDS, stride_tb, stride_th,
                         stride_tq, SCHED, n_items, n_tiles, Hq, Sq, Sk, lo, hi, kv_global, q_global, qk_scale,
                         softcap_scale, 1, MASK_BS, MASK_KIND, HAS_DOC, HAS_GLOBAL, EVEN_SK, BLOCK_N, BLOCK_D, STAGES,
                         PIPE, SOFTCAP)),
        (_fwd_producer, (desc_q, desc_k, desc_v, q_smem, k_smem, v_smem, q_bar, q_free, k_ready, k_empty, v_ready,
                         v_empty, tickets, tk_ready, tk_empty, CNT,
                         KV_NUM, KV_IDX, FULL_NUM, FULL_IDX, stride_nb, stride_nh, stride_ib, stride_ih, stride_iq,
                         SCHED, n_items, n_tiles, Hq, GROUP, MASK_BS, BLOCK_N, STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# -- backward -------------------------------------------------------------------------------------------------


@gluon.jit
def _bwd_load_list(desc_q, desc_do, desc_lse2, desc_delta, q_smem, do_smem, lse2_smem, delta_smem, q_ready,
                   do_ready, q_empty, off_b, off_h, row0, IDX_row, n_tiles, i,
                   MASK_BS: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
    SUB: gl.constexpr = MASK_BS // BLOCK_M
    for j in range(n_tiles):
        start_m = gl.load(IDX_row + j // SUB) * MASK_BS + (j % SUB) * BLOCK_M
        s = i % STAGES
        ph = (i // STAGES) & 1
        mbarrier.wait(q_empty.index(s), ph ^ 1)
        mbarrier.expect(q_ready.index(s), desc_q.block_type.nbytes + desc_lse2.block_type.nbytes)
        bws._tma_load(desc_q, [off_b, off_h, start_m, 0], q_ready.index(s), q_smem.index(s))
        bws._tma_load(desc_lse2, [row0 + start_m], q_ready.index(s), lse2_smem.index(s))
        mbarrier.expect(do_ready.index(s), desc_do.block_type.nbytes + desc_delta.block_type.nbytes)
        bws._tma_load(desc_do, [off_b, off_h, start_m, 0], do_ready.index(s), do_smem.index(s))
        bws._tma_load(desc_delta, [row0 + start_m], do_ready.index(s), delta_smem.index(s))
        i += 1
    return i


@gluon.jit
def _bwd_producer(desc_q, desc_k, desc_v, desc_do, desc_lse2, desc_delta, q_smem, do_smem, k_smem, v_smem, lse2_smem,
                  delta_smem, kv_bar, kv_free, q_ready, do_ready, q_empty, tickets, tk_ready, tk_empty, CNT,
                  Q_NUM, Q_IDX, FULL_NUM, FULL_IDX, stride_nb, stride_nh, stride_ib, stride_ih, stride_ik,
                  SCHED, n_items, n_tiles, Hq, Hkv, GROUP, stride_lse,
                  MASK_BS: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
    """One warp, per work item until the tickets run out: K and V of the CTA (once the consumers freed them), then,
    per query head of the group, Q / lse2 and dO / Delta of the query tiles of the kv block's full query blocks,
    then of its partial ones."""
    SUB: gl.constexpr = MASK_BS // BLOCK_M
    t = gl.program_id(0)
    nprog = gl.num_programs(0)
    e = _entry(t, SCHED)
    n = 0
    i = 0
    while t < n_items:
        mbarrier.wait(kv_free.index(0), (n & 1) ^ 1)
        off_b, off_kvh, start_n = _decode(e, n_tiles, Hkv)
        mbarrier.expect(kv_bar, desc_k.block_type.nbytes + desc_v.block_type.nbytes)
        bws._tma_load(desc_k, [off_b, off_kvh, start_n, 0], kv_bar, k_smem)
        bws._tma_load(desc_v, [off_b, off_kvh, start_n, 0], kv_bar, v_smem)
        for g in range(GROUP):
            off_h = off_kvh * GROUP + g
            row0 = (off_b * Hq + off_h) * stride_lse
            n_full, FULL_row, n_part, PART_row = _lists(Q_NUM, Q_IDX, FULL_NUM, FULL_IDX, stride_nb, stride_nh,
                                                        stride_ib, stride_ih, stride_ik, off_b, off_h,
                                                        start_n // MASK_BS)
            i = _bwd_load_list(desc_q, desc_do, desc_lse2, desc_delta, q_smem, do_smem, lse2_smem, delta_smem,
                               q_ready, do_ready, q_empty, off_b, off_h, row0, FULL_row, n_full * SUB, i, MASK_BS,
                               BLOCK_M, STAGES)
            i = _bwd_load_list(desc_q, desc_do, desc_lse2, desc_delta, q_smem, do_smem, lse2_smem, delta_smem,
                               q_ready, do_ready, q_empty, off_b, off_h, row0, PART_row, n_part * SUB, i, MASK_BS,
                               BLOCK_M, STAGES)
        t, e, _, _ = _next_item(CNT, nprog, tickets, tk_ready, tk_empty, n, n_items, SCHED, Q_NUM, FULL_NUM,
                                stride_nb, stride_nh, n_tiles, Hkv, MASK_BS, False)
        n += 1


@gluon.jit
def _bwd_run(dk, dv, i, k_w, v_w, k_all, q_smem, do_smem, ds_smem, q_ready, do_ready, q_empty, ds_ready, ds_free,
             lse2_smem, delta_smem, DQA_bh, stride_dqam, desc_dqa, dq_smem, off_b, off_h, offs_n, kd, kp, IDX_row,
             n_tiles, kb, QDOC_b, QPOS_b, TILE_IDS_bh, stride_tq, TILES, Sq, Sk, lo, hi, kv_global, q_global,
             qk_scale, sm_scale, softcap_scale, WG: gl.constexpr, s_layout: gl.constexpr, op_layout: gl.constexpr,
             dq_layout: gl.constexpr, MASKED: gl.constexpr, MASK_KIND: gl.constexpr, HAS_DOC: gl.constexpr,
             HAS_GLOBAL: gl.constexpr, MASK_BS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_D: gl.constexpr,
             STAGES: gl.constexpr, DQ_SPLIT_M: gl.constexpr, EARLY_DV: gl.constexpr, SOFTCAP: gl.constexpr):
    """The listed query tiles of one query head; MASKED: the element mask of MASK_KIND and the bounds (0: the
    bounds only), else none; SOFTCAP: the logit softcap (`flash_bwd_ws`)."""
    SUB: gl.constexpr = MASK_BS // BLOCK_M
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    for j in range(n_tiles):
        qb = gl.load(IDX_row + j // SUB)
        start_m = qb * MASK_BS + (j % SUB) * BLOCK_M
        if MASKED:
            rows = start_m + gl.arange(0, BLOCK_M, layout=col_s)
            qd, qp = _tokens(QDOC_b, QPOS_b, rows, Sq, -1, MASK_KIND, HAS_DOC, True)
            # rows past Sq read another head's (finite) lse2 / Delta: their P must be 0 (dQ has no such rows)
            keep = _visible(rows[None, :], offs_n[:, None], qd[None, :], kd[:, None], qp[None, :], kp[:, None], qb,
                            kb, TILE_IDS_bh, stride_tq, TILES, Sk, lo, hi, kv_global, q_global,
                            MASK_KIND, HAS_DOC, HAS_GLOBAL, MASK_BS) & (rows[None, :] < Sq)
            dk, dv = bws._tile(dk, dv, i, k_w, v_w, k_all, q_smem, do_smem, ds_smem, q_ready, do_ready, q_empty,
                               ds_ready, ds_free, lse2_smem, delta_smem, DQA_bh, stride_dqam, offs_n, start_m, keep,
                               Sq, Sk, lo, hi, qk_scale, sm_scale, desc_dqa, dq_smem, off_b, off_h, True, WG,
                               s_layout, op_layout, dq_layout, 2, False, False, BLOCK_M, BLOCK_D, STAGES, DQ_SPLIT_M,
                               EARLY_DV, softcap_scale, SOFTCAP)
        else:
            dk, dv = bws._tile(dk, dv, i, k_w, v_w, k_all, q_smem, do_smem, ds_smem, q_ready, do_ready, q_empty,
                               ds_ready, ds_free, lse2_smem, delta_smem, DQA_bh, stride_dqam, offs_n, start_m, 0,
                               Sq, Sk, lo, hi, qk_scale, sm_scale, desc_dqa, dq_smem, off_b, off_h, True, WG,
                               s_layout, op_layout, dq_layout, False, False, False, BLOCK_M, BLOCK_D, STAGES,
                               DQ_SPLIT_M, EARLY_DV, softcap_scale, SOFTCAP)
        i += 1
    return dk, dv, i


@gluon.jit
def _bwd_item(e, n, i, q_smem, do_smem, k_smem, v_smem, lse2_smem, delta_smem, ds_smem, kv_bar, kv_free, q_ready,
              do_ready, q_empty, ds_ready, ds_free, DK, DV, DQA, desc_dqa, dq_smem, desc_dk, desc_dv,
              stride_dkb, stride_dkh, stride_dkn, stride_dkd,
              stride_dvb, stride_dvh, stride_dvn, stride_dvd,
              stride_dqab, stride_dqah, stride_dqam,
              Q_NUM, Q_IDX, FULL_NUM, FULL_IDX, stride_nb, stride_nh, stride_ib, stride_ih, stride_ik,
              QDOC, KDOC, QPOS, KPOS, stride_qdoc, stride_kdoc, TILES, TILE_IDS, stride_tb, stride_th, stride_tq,
              SCHED, n_tiles, Hq, Hkv, Sq, Sk, GROUP, lo, hi, kv_global, q_global, qk_scale, sm_scale, softcap_scale,
              WG: gl.constexpr, MASK_BS: gl.constexpr, MASK_KIND: gl.constexpr, HAS_DOC: gl.constexpr,
              HAS_GLOBAL: gl.constexpr, EVEN: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_D: gl.constexpr,
              STAGES: gl.constexpr, DQ_SPLIT_M: gl.constexpr, EARLY_DV: gl.constexpr, SOFTCAP: gl.constexpr,
              DKDV_TMA: gl.constexpr):
    """Work item entry ``e`` (`_entry`), the CTA's ``n``-th, for one warpgroup: dK and dV of 64 keys, summed over the group's query
    heads; its share of dQ. ``i`` counts the query tiles consumed so far (ring slot and phase); returns it."""
    s_layout: gl.constexpr = fws.wgmma_layout(BLOCK_M)
    acc_layout: gl.constexpr = fws.wgmma_layout(BLOCK_D)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    if DQ_SPLIT_M:
        dq_layout: gl.constexpr = fws.wgmma_layout(BLOCK_D)
    else:
        dq_layout: gl.constexpr = fws.wgmma_layout(BLOCK_D // 2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    SUB: gl.constexpr = MASK_BS // BLOCK_M

    off_b, off_kvh, start_n = _decode(e, n_tiles, Hkv)
    kb = start_n // MASK_BS
    my_n = start_n + WG * WG_ROWS
    offs_n = my_n + gl.arange(0, WG_ROWS, layout=row_s)
    kd, kp = _tokens(KDOC + off_b.to(gl.int64) * stride_kdoc, KPOS + off_b.to(gl.int64) * stride_kdoc, offs_n, Sk,
                     -2, MASK_KIND, HAS_DOC, False)
    QDOC_b = QDOC + off_b.to(gl.int64) * stride_qdoc
    QPOS_b = QPOS + off_b.to(gl.int64) * stride_qdoc
    k_all = k_smem.reshape([CTA_ROWS, BLOCK_D])
    v_all = v_smem.reshape([CTA_ROWS, BLOCK_D])
    k_w = k_all.slice(WG * WG_ROWS, WG_ROWS, dim=0)
    v_w = v_all.slice(WG * WG_ROWS, WG_ROWS, dim=0)
    dk = gl.zeros([WG_ROWS, BLOCK_D], gl.float32, layout=acc_layout)
    dv = gl.zeros([WG_ROWS, BLOCK_D], gl.float32, layout=acc_layout)
    mbarrier.wait(kv_bar, n & 1)
    for g in range(GROUP):
        off_h = off_kvh * GROUP + g
        DQA_bh = DQA + off_b.to(gl.int64) * stride_dqab + off_h.to(gl.int64) * stride_dqah
        TILE_IDS_bh = TILE_IDS + off_b.to(gl.int64) * stride_tb + off_h.to(gl.int64) * stride_th
        n_full, FULL_row, n_part, PART_row = _lists(Q_NUM, Q_IDX, FULL_NUM, FULL_IDX, stride_nb, stride_nh,
                                                    stride_ib, stride_ih, stride_ik, off_b, off_h, kb)
        # full blocks: no element mask where Sq and Sk end on block boundaries (else the bounds)
        dk, dv, i = _bwd_run(dk, dv, i, k_w, v_w, k_all, q_smem, do_smem, ds_smem, q_ready, do_ready, q_empty,
                             ds_ready, ds_free, lse2_smem, delta_smem, DQA_bh, stride_dqam, desc_dqa,
                             dq_smem.index(WG), off_b, off_h, offs_n, kd, kp, FULL_row, n_full * SUB, kb, QDOC_b,
                             QPOS_b, TILE_IDS_bh, stride_tq, TILES, Sq, Sk, lo, hi, kv_global, q_global, qk_scale,
                             sm_scale, softcap_scale, WG, s_layout, op_layout, dq_layout, not EVEN, 0, False, False,
                             MASK_BS, BLOCK_M, BLOCK_D, STAGES, DQ_SPLIT_M, EARLY_DV, SOFTCAP)
        dk, dv, i = _bwd_run(dk, dv, i, k_w, v_w, k_all, q_smem, do_smem, ds_smem, q_ready, do_ready, q_empty,
                             ds_ready, ds_free, lse2_smem, delta_smem, DQA_bh, stride_dqam, desc_dqa,
                             dq_smem.index(WG), off_b, off_h, offs_n, kd, kp, PART_row, n_part * SUB, kb, QDOC_b,
                             QPOS_b, TILE_IDS_bh, stride_tq, TILES, Sq, Sk, lo, hi, kv_global, q_global, qk_scale,
                             sm_scale, softcap_scale, WG, s_layout, op_layout, dq_layout, True, MASK_KIND, HAS_DOC,
                             HAS_GLOBAL, MASK_BS, BLOCK_M, BLOCK_D, STAGES, DQ_SPLIT_M, EARLY_DV, SOFTCAP)
    mbarrier.arrive(kv_free.index(0), count=1)  # the item's wgmmas are done: K / V may be refilled
    if DKDV_TMA:
        _store_dkdv_tma(dk, dv, desc_dk, desc_dv, dq_smem.index(WG), off_b, off_kvh, my_n, sm_scale, BLOCK_D)
    else:
        # 128-row query tiles (the dQ tile is too small for dK / dV) or float32 dK / dV: they leave from registers
        bws.tma.store_wait(0)  # the last dQ reduction has read its shared tile
        bws._store_dkdv(dk, dv, DK, DV, stride_dkb, stride_dkh, stride_dkn, stride_dkd, stride_dvb, stride_dvh,
                        stride_dvn, stride_dvd, off_b, off_kvh, my_n, Sk, sm_scale, acc_layout, BLOCK_D)
    return i


@gluon.jit
def _bwd_consumer(q_smem, do_smem, k_smem, v_smem, lse2_smem, delta_smem, ds_smem, kv_bar, kv_free, q_ready, do_ready,
                  q_empty, ds_ready, ds_free, tickets, tk_ready, tk_empty, DK, DV, DQA, desc_dqa, dq_smem, desc_dk,
                  desc_dv,
                  stride_dkb, stride_dkh, stride_dkn, stride_dkd,
                  stride_dvb, stride_dvh, stride_dvn, stride_dvd,
                  stride_dqab, stride_dqah, stride_dqam,
                  Q_NUM, Q_IDX, FULL_NUM, FULL_IDX, stride_nb, stride_nh, stride_ib, stride_ih, stride_ik,
                  QDOC, KDOC, QPOS, KPOS, stride_qdoc, stride_kdoc, TILES, TILE_IDS, stride_tb, stride_th, stride_tq,
                  SCHED, n_items, n_tiles, Hq, Hkv, Sq, Sk, GROUP, lo, hi, kv_global, q_global, qk_scale, sm_scale,
                  softcap_scale, WG: gl.constexpr, MASK_BS: gl.constexpr, MASK_KIND: gl.constexpr,
                  HAS_DOC: gl.constexpr, HAS_GLOBAL: gl.constexpr, EVEN: gl.constexpr, BLOCK_M: gl.constexpr,
                  BLOCK_D: gl.constexpr, STAGES: gl.constexpr, DQ_SPLIT_M: gl.constexpr, EARLY_DV: gl.constexpr,
                  SOFTCAP: gl.constexpr, DKDV_TMA: gl.constexpr):
    """One warpgroup: its 64 keys of every item the producer hands out, until the tickets run out."""
    t = gl.program_id(0)
    e = _entry(t, SCHED)
    n = 0
    i = 0
    while t < n_items:
        i = _bwd_item(e, n, i, q_smem, do_smem, k_smem, v_smem, lse2_smem, delta_smem, ds_smem, kv_bar, kv_free,
                      q_ready, do_ready, q_empty, ds_ready, ds_free, DK, DV, DQA, desc_dqa, dq_smem, desc_dk,
                      desc_dv,
                      stride_dkb, stride_dkh, stride_dkn, stride_dkd, stride_dvb, stride_dvh, stride_dvn,
                      stride_dvd, stride_dqab, stride_dqah, stride_dqam,
                      Q_NUM, Q_IDX, FULL_NUM, FULL_IDX, stride_nb, stride_nh, stride_ib, stride_ih, stride_ik,
                      QDOC, KDOC, QPOS, KPOS, stride_qdoc, stride_kdoc, TILES, TILE_IDS, stride_tb, stride_th,
                      stride_tq, SCHED, n_tiles, Hq, Hkv, Sq, Sk, GROUP, lo, hi, kv_global, q_global, qk_scale,
                      sm_scale, softcap_scale, WG, MASK_BS, MASK_KIND, HAS_DOC, HAS_GLOBAL, EVEN, BLOCK_M, BLOCK_D,
                      STAGES, DQ_SPLIT_M, EARLY_DV, SOFTCAP, DKDV_TMA)
        t, e, _, _ = _read_ticket(tickets, tk_ready, tk_empty, n)
        n += 1
    bws.tma.store_wait(0)  # the last copy out of shared memory is done before the CTA ends


@gluon.jit(do_not_specialize=_RUNTIME_INTS + ["stride_lse", "stride_ik"])
def sparse_bwd_ws_kernel(
    desc_q, desc_k, desc_v, desc_do, desc_lse2, desc_delta, DK, DV, DQA, desc_dqa, desc_dk, desc_dv,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    stride_dqab, stride_dqah, stride_dqam,
    Q_NUM, Q_IDX, FULL_NUM, FULL_IDX, stride_nb, stride_nh, stride_ib, stride_ih, stride_ik,
    QDOC, KDOC, QPOS, KPOS, stride_qdoc, stride_kdoc, TILES, TILE_IDS, stride_tb, stride_th, stride_tq,
    SCHED, CNT, n_items, n_tiles, Hq, Hkv, Sq, Sk, GROUP, lo, hi, kv_global, q_global, stride_lse, qk_scale,
    sm_scale, softcap_scale,
    BLOCK_D: gl.constexpr, MASK_BS: gl.constexpr, MASK_KIND: gl.constexpr, HAS_DOC: gl.constexpr,
    HAS_GLOBAL: gl.constexpr, EVEN: gl.constexpr,
    BLOCK_M: gl.constexpr, STAGES: gl.constexpr, EARLY_DV: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, SOFTCAP: gl.constexpr = False,
    DKDV_16BIT: gl.constexpr = True,
):
    """Grid: (at most one CTA per SM,), each taking work items ``tile + n_tiles * (b * Hkv + h)`` (tiles of 128
    keys) in the order of SCHED by ticket from the zeroed int32 counter CNT (the next item's K / V load once both
    consumers are done with this one's); dK / dV leave through desc_dk / desc_dv, block (1, 1, 64, BLOCK_D), with
    64-row query tiles and 16-bit gradients (DKDV_16BIT; float32 dK / dV leave from registers); num_warps=4 plus the workers' 4 + 1 warps. Descriptors, lse2 / Delta and DQA / desc_dqa (dQ
    by the copy engine's bulk reduction) as `flash_bwd_ws.attn_bwd_ws_kernel`'s; the transposed block lists and the
    mask arguments as `flash_sparse.sparse_bwd_dkdv_kernel`'s. EVEN: Sq and Sk are multiples of MASK_BS. SOFTCAP,
    qk_scale, sm_scale and softcap_scale as `flash_bwd_ws.attn_bwd_ws_kernel`'s."""
    DQ_SPLIT_M: gl.constexpr = BLOCK_M == CTA_ROWS
    # dK / dV by the copy engine through the dQ tile (64-row query tiles, 16-bit gradients); else from registers
    DKDV_TMA: gl.constexpr = DKDV_16BIT and not DQ_SPLIT_M
    (q_smem, do_smem, k_smem, v_smem, lse2_smem, delta_smem, ds_smem, kv_bar, q_ready, do_ready, q_empty, ds_ready,
     ds_free, dq_smem) = bws._shared(desc_q, desc_k, desc_v, desc_do, desc_lse2, desc_delta, desc_dqa, BLOCK_M,
                                     STAGES, True)
    tickets, tk_ready, tk_empty, kv_free = _persistent_shared(1, True)

    gl.warp_specialize([
        (_bwd_consumer, (q_smem, do_smem, k_smem, v_smem, lse2_smem, delta_smem, ds_smem, kv_bar, kv_free, q_ready,
                         do_ready, q_empty, ds_ready, ds_free, tickets, tk_ready, tk_empty, DK, DV, DQA, desc_dqa,
                         dq_smem, desc_dk, desc_dv, stride_dkb, stride_dkh, stride_dkn, stride_dkd,
                         stride_dvb, stride_dvh, stride_dvn, stride_dvd, stride_dqab, stride_dqah, stride_dqam,
                         Q_NUM, Q_IDX, FULL_NUM, FULL_IDX, stride_nb, stride_nh, stride_ib, stride_ih, stride_ik,
                         QDOC, KDOC, QPOS, KPOS, stride_qdoc, stride_kdoc, TILES, TILE_IDS, stride_tb, stride_th,
                         stride_tq, SCHED, n_items, n_tiles, Hq, Hkv, Sq, Sk, GROUP, lo, hi, kv_global, q_global,
                         qk_scale, sm_scale, softcap_scale, 0, MASK_BS, MASK_KIND, HAS_DOC, HAS_GLOBAL, EVEN, BLOCK_M,
                         BLOCK_D, STAGES, DQ_SPLIT_M, EARLY_DV, SOFTCAP, DKDV_TMA)),
        (_bwd_consumer, (q_smem, do_smem, k_smem, v_smem, lse2_smem, delta_smem, ds_smem, kv_bar, kv_free, q_ready,
                         do_ready, q_empty, ds_ready, ds_free, tickets, tk_ready, tk_empty, DK, DV, DQA, desc_dqa,
                         dq_smem, desc_dk, desc_dv, stride_dkb, stride_dkh, stride_dkn, stride_dkd,
                         stride_dvb, stride_dvh, stride_dvn, stride_dvd, stride_dqab, stride_dqah, stride_dqam,
                         Q_NUM, Q_IDX, FULL_NUM, FULL_IDX, stride_nb, stride_nh, stride_ib, stride_ih, stride_ik,
                         QDOC, KDOC, QPOS, KPOS, stride_qdoc, stride_kdoc, TILES, TILE_IDS, stride_tb, stride_th,
                         stride_tq, SCHED, n_items, n_tiles, Hq, Hkv, Sq, Sk, GROUP, lo, hi, kv_global, q_global,
                         qk_scale, sm_scale, softcap_scale, 1, MASK_BS, MASK_KIND, HAS_DOC, HAS_GLOBAL, EVEN, BLOCK_M,
                         BLOCK_D, STAGES, DQ_SPLIT_M, EARLY_DV, SOFTCAP, DKDV_TMA)),
        (_bwd_producer, (desc_q, desc_k, desc_v, desc_do, desc_lse2, desc_delta, q_smem, do_smem, k_smem, v_smem,
                         lse2_smem, delta_smem, kv_bar, kv_free, q_ready, do_ready, q_empty, tickets, tk_ready,
                         tk_empty, CNT, Q_NUM, Q_IDX, FULL_NUM, FULL_IDX, stride_nb, stride_nh, stride_ib, stride_ih,
                         stride_ik, SCHED, n_items, n_tiles, Hq, Hkv, GROUP, stride_lse, MASK_BS, BLOCK_M, STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
