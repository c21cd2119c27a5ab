"""Block-sparse attention masks: FlexAttention's ``mask_mod`` contract, stored per block like its BlockMask.

A mask is described element by element by a ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor`` (True: the
query may see the key; indices are absolute, i.e. top-left aligned, as in FlexAttention) and stored per
(query block, key block) of ``block_size`` x ``block_size`` entries:

    EMPTY    every entry masked          -> skipped by every kernel
    FULL     every entry visible         -> computed without any per-element mask
    PARTIAL  a mix                       -> the element mask is applied inside the tile

For each (batch, head, query block) the mask keeps the kv blocks that are full and the ones that are partial
(``full_kv_num_blocks``/``full_kv_indices`` and ``kv_num_blocks``/``kv_indices``, FlexAttention's names), and
the transposed lists per (batch, head, kv block) that the dK/dV backward walks (``full_q_num_blocks``,
``full_q_indices``, ``q_num_blocks``, ``q_indices``). Batch and head dimensions of size 1 broadcast.

How partial tiles know their elements (what the kernels read):

* ready-made masks (`causal_mask`, `sliding_window_mask`, `document_mask`, `prefix_lm_mask`,
  `local_global_mask` and their ``&``) carry an *analytic* rule, `DocBand`: per-token document ids and
  positions plus a band and optional global rows/columns. The block classification is computed from block
  minima/maxima in O(number of blocks) and refined exactly on the few boundary tiles; kernels re-evaluate
  the rule in registers. Nothing of size Sq x Sk is ever built, so S = 64K takes milliseconds.
* any other mask_mod is evaluated on the whole grid in row chunks on the mask's device; the partial tiles
  are kept as bool tiles ``(n_partial, block_size, block_size)`` and ``tile_ids[b, h, qb, kb]`` points into
  them (1 byte per entry of a partial tile).
* `BlockMask.from_layout` (the FlashAttention paper's block-sparse form) has only full blocks.

    bm = longctx.block_mask(longctx.block_sparse.causal_mask, None, None, S, S, device="cuda")
    out = longctx.attention(q, k, v, block_mask=bm)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = [
    "BlockMask",
    "DocBand",
    "MaskMod",
    "block_mask",
    "and_masks",
    "or_masks",
    "causal_mask",
    "sliding_window_mask",
    "document_mask",
    "prefix_lm_mask",
    "local_global_mask",
    "full_mask",
]

EMPTY, FULL, PARTIAL = 0, 1, 2
# Sentinels for an unbounded band side, small enough for int32 arithmetic in the kernels.
BIG = 1 << 30


# ----------------------------------------------------------------------------------------------------------
# The analytic rule behind the ready-made masks
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class DocBand:
    """Query i sees key j iff ``(same document and lo <= kpos[j] - qpos[i] <= hi) or j < kv_global or i < q_global``.

    Documents: ``q_doc``/``k_doc`` per-token ids, (S,) or (B, S); None means one document. Positions:
    ``q_pos``/``k_pos``, (S,) or (B, S), None means the index itself. ``lo``/``hi`` None are unbounded.
    """

    q_doc: torch.Tensor | None = None
    k_doc: torch.Tensor | None = None
    q_pos: torch.Tensor | None = None
    k_pos: torch.Tensor | None = None
    lo: int | None = None
    hi: int | None = None
    kv_global: int = 0
    q_global: int = 0

    @property
    def has_doc(self) -> bool:
        return self.q_doc is not None

    @property
    def has_pos(self) -> bool:
        return self.q_pos is not None or self.k_pos is not None

    def batch(self) -> int:
        ts = [t for t in (self.q_doc, self.k_doc, self.q_pos, self.k_pos) if t is not None and t.dim() == 2]
        return max([t.shape[0] for t in ts], default=1)

    def tensors(self, sq: int, sk: int, device) -> tuple[torch.Tensor, ...]:
        """(q_doc, k_doc, q_pos, k_pos) as int32 (Bd, S) tensors on ``device``."""
        bd = self.batch()

        def norm(t, n, default):
            if t is None:
                t = default(n)
            t = t.to(device=device, dtype=torch.int32)
            if t.dim() == 1:
                t = t.unsqueeze(0)
            if t.shape[-1] != n:
                raise ValueError(f"a per-token tensor of the mask has length {t.shape[-1]}, expected {n}")
            return t.expand(bd, n).contiguous()

        zeros = lambda n: torch.zeros(n, dtype=torch.int32)
        ar = lambda n: torch.arange(n, dtype=torch.int32)
        return (
            norm(self.q_doc, sq, zeros),
            norm(self.k_doc, sk, zeros),
            norm(self.q_pos, sq, ar),
            norm(self.k_pos, sk, ar),
        )

    def bounds(self) -> tuple[int, int]:
        return (-BIG if self.lo is None else int(self.lo), BIG if self.hi is None else int(self.hi))

    def intervals(self, sq: int, sk: int, device) -> tuple[torch.Tensor, ...] | None:
        """The rule as per-token intervals where it is one: ``(row_lo, col_lo, row_hi, col_hi)``, int32 (Bd, S),
        query i seeing exactly the keys ``row_lo[i] <= j <= row_hi[i]`` and key j seen by exactly the queries
        ``col_lo[j] <= i <= col_hi[j]`` (empty: lo > hi). That holds without global rows / columns when every
        document is one contiguous run of tokens (ids non-decreasing) whose positions step by one (the index
        itself, or the place inside the document): then a row's keys in its document within the band are a
        range. None otherwise. The kernels then test a partial tile's elements against two numbers per row (or
        column) read once per CTA, instead of reading both sides' ids and positions for every tile."""
        if self.kv_global or self.q_global or sq == 0 or sk == 0:
            return None
        qd, kd, qp, kp = (t.to(torch.int64) for t in self.tensors(sq, sk, device))

        def runs_ok(d, p):  # ids non-decreasing; positions +1 inside a document
            if d.shape[-1] < 2:
                return True
            same = d[:, 1:] == d[:, :-1]
            return bool(((d[:, 1:] >= d[:, :-1]) & (~same | (p[:, 1:] - p[:, :-1] == 1))).all())

        if not (runs_ok(qd, qp) and runs_ok(kd, kp)):
            return None
        lo, hi = self.bounds()

        def side(d_self, p_self, d_other, p_other, n_other, a, b):
            # tokens of the other side in the same document: [start, end); inside it p_other = index + shift.
            # Visible: a <= p_other - p_self <= b (keys of a query: a, b = lo, hi; queries of a key: -hi, -lo).
            start = torch.searchsorted(d_other.contiguous(), d_self.contiguous(), right=False)
            end = torch.searchsorted(d_other.contiguous(), d_self.contiguous(), right=True)
            first = start.clamp(max=n_other - 1)
            shift = torch.gather(p_other, 1, first) - first
            v_lo = torch.maximum(start, p_self + a - shift)
            v_hi = torch.minimum(end - 1, p_self + b - shift)
            empty = (end == start) | (v_lo > v_hi)
            v_lo = torch.where(empty, n_other, v_lo).clamp(-1, n_other)
            v_hi = torch.where(empty, -1, v_hi).clamp(-1, n_other)
            return v_lo.to(torch.int32).contiguous(), v_hi.to(torch.int32).contiguous()

        row_lo, row_hi = side(qd, qp, kd, kp, sk, lo, hi)
        col_lo, col_hi = side(kd, kp, qd, qp, sq, -hi, -lo)
        return row_lo, col_lo, row_hi, col_hi

    def visible(self, qd, kd, qp, kp, qi, kj) -> torch.Tensor:
        """Element rule on broadcastable per-token tensors (documents, positions and absolute indices)."""
        lo, hi = self.bounds()
        d = kp.to(torch.int64) - qp.to(torch.int64)
        vis = (d >= lo) & (d <= hi)
        if self.has_doc:
            vis = vis & (qd == kd)
        if self.kv_global > 0:
            vis = vis | (kj < self.kv_global)
        if self.q_global > 0:
            vis = vis | (qi < self.q_global)
        return vis


class MaskMod:
    """A ``mask_mod(b, h, q_idx, kv_idx)`` callable that may carry an analytic `DocBand` (the fast path)."""

    def __init__(self, fn: Callable, analytic: DocBand | None = None, name: str = "mask_mod"):
        self.fn = fn
        self.analytic = analytic
        self.name = name

    def __call__(self, b, h, q_idx, kv_idx):
        return self.fn(b, h, q_idx, kv_idx)

    def __and__(self, other):
        return and_masks(self, other)

    def __or__(self, other):
        return or_masks(self, other)

    def __repr__(self) -> str:
        return self.name


def _intersect(a: int | None, b: int | None, pick) -> int | None:
    if a is None:
        return b
    if b is None:
        return a
    return pick(a, b)


def _combine_and(a: DocBand, b: DocBand) -> DocBand | None:
    # (doc & band) AND (doc & band) stays in the form; OR-ed global rows/columns do not.
    if a.kv_global or a.q_global or b.kv_global or b.q_global:
        return None
    if a.has_doc and b.has_doc and not (a.q_doc is b.q_doc and a.k_doc is b.k_doc):
        return None
    if a.has_pos and b.has_pos and not (a.q_pos is b.q_pos and a.k_pos is b.k_pos):
        return None
    d = a if a.has_doc else b
    p = a if a.has_pos else b
    return DocBand(
        q_doc=d.q_doc,
        k_doc=d.k_doc,
        q_pos=p.q_pos,
        k_pos=p.k_pos,
        lo=_intersect(a.lo, b.lo, max),
        hi=_intersect(a.hi, b.hi, min),
    )


def and_masks(*mods: Callable) -> MaskMod:
    """The intersection of mask_mods (FlexAttention's ``and_masks``); keeps the fast path where it can."""
    if not mods:
        raise ValueError("and_masks needs at least one mask_mod")

    def fn(b, h, q, kv):
        out = mods[0](b, h, q, kv)
        for m in mods[1:]:
            out = out & m(b, h, q, kv)
        return out

    analytic = getattr(mods[0], "analytic", None)
    for m in mods[1:]:
        other = getattr(m, "analytic", None)
        analytic = None if analytic is None or other is None else _combine_and(analytic, other)
    return MaskMod(fn, analytic, " & ".join(repr(m) if isinstance(m, MaskMod) else "mask_mod" for m in mods))


def or_masks(*mods: Callable) -> MaskMod:
    """The union of mask_mods (FlexAttention's ``or_masks``); evaluated on the general path."""
    if not mods:
        raise ValueError("or_masks needs at least one mask_mod")

    def fn(b, h, q, kv):
        out = mods[0](b, h, q, kv)
        for m in mods[1:]:
            out = out | m(b, h, q, kv)
        return out

    return MaskMod(fn, None, " | ".join(repr(m) if isinstance(m, MaskMod) else "mask_mod" for m in mods))


def _check_pos_int(name: str, val, minimum: int) -> int:
    if isinstance(val, bool) or not isinstance(val, int):
        raise TypeError(f"{name} must be an int, got {type(val).__name__} ({val!r})")
    if val < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {val}")
    return val


full_mask = MaskMod(lambda b, h, q, kv: torch.ones_like(q >= kv), DocBand(), "full")
full_mask.__doc__ = "Every key visible (a dense mask)."

causal_mask = MaskMod(lambda b, h, q, kv: q >= kv, DocBand(hi=0), "causal")
causal_mask.__doc__ = "Query i sees keys j <= i (absolute indices: top-left aligned, as FlexAttention)."


def sliding_window_mask(window: int) -> MaskMod:
    """Causal sliding window of ``window`` keys: query i sees keys ``i - window < j <= i``."""
    window = _check_pos_int("window", window, 1)
    return MaskMod(
        lambda b, h, q, kv: (q >= kv) & (q - kv < window),
        DocBand(lo=-(window - 1), hi=0),
        f"sliding_window({window})",
    )


def document_mask(doc_ids: torch.Tensor, kv_doc_ids: torch.Tensor | None = None) -> MaskMod:
    """Packed documents: query i sees key j iff ``doc_ids[i] == kv_doc_ids[j]`` (default: the same ids).

    ``doc_ids`` is (S,) or (B, S) integer; combine with `causal_mask` (``document_mask(ids) & causal_mask``)
    for causal attention inside each document (positions are the packed indices; for documents of equal
    length on both sides this is causal inside each document).
    """
    if not isinstance(doc_ids, torch.Tensor) or doc_ids.is_floating_point() or doc_ids.dim() not in (1, 2):
        raise TypeError("doc_ids must be an integer tensor of shape (S,) or (B, S)")
    kv = doc_ids if kv_doc_ids is None else kv_doc_ids
    if not isinstance(kv, torch.Tensor) or kv.is_floating_point() or kv.dim() not in (1, 2):
        raise TypeError("kv_doc_ids must be an integer tensor of shape (S,) or (B, S)")

    def fn(b, h, q, k):
        qd = doc_ids[q] if doc_ids.dim() == 1 else doc_ids[b][q]
        kd = kv[k] if kv.dim() == 1 else kv[b][k]
        return qd == kd

    return MaskMod(fn, DocBand(q_doc=doc_ids, k_doc=kv), "document")


def prefix_lm_mask(prefix_len: int) -> MaskMod:
    """Prefix-LM: every query sees the first ``prefix_len`` keys; beyond them attention is causal."""
    prefix_len = _check_pos_int("prefix_len", prefix_len, 0)
    return MaskMod(
        lambda b, h, q, kv: (kv < prefix_len) | (q >= kv),
        DocBand(hi=0, kv_global=prefix_len),
        f"prefix_lm({prefix_len})",
    )


def local_global_mask(window: int, global_tokens: int) -> MaskMod:
    """Longformer/BigBird style: ``|i - j| < window``, plus ``global_tokens`` global rows and columns.

    The first ``global_tokens`` queries see every key and the first ``global_tokens`` keys are seen by every
    query.
    """
    window = _check_pos_int("window", window, 1)
    g = _check_pos_int("global_tokens", global_tokens, 0)
    return MaskMod(
        lambda b, h, q, kv: ((q - kv).abs() < window) | (q < g) | (kv < g),
        DocBand(lo=-(window - 1), hi=window - 1, kv_global=g, q_global=g),
        f"local_global({window}, {g})",
    )


# ----------------------------------------------------------------------------------------------------------
# BlockMask
# ----------------------------------------------------------------------------------------------------------


def _lists(sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of a bool (..., n_outer, n_inner) selection: count and ascending indices (padded), int32."""
    num = sel.sum(-1, dtype=torch.int32)
    # a stable sort of "not selected" puts the selected indices first, in ascending order
    idx = torch.sort((~sel).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)
    return num.contiguous(), idx.contiguous()


class BlockMask:
    """A block-sparse attention mask (see the module docstring). Build with `block_mask` or `from_layout`.

    Attributes (Bm in {1, B}, Hm in {1, Hq}: size 1 broadcasts; nQ, nK numbers of blocks):
        block_size: rows and columns of one block.
        seq_len_q, seq_len_kv: Sq, Sk.
        block_kind: (Bm, Hm, nQ, nK) int8, 0 empty / 1 full / 2 partial.
        kv_num_blocks, kv_indices: partial kv blocks per query block, (Bm, Hm, nQ) and (Bm, Hm, nQ, nK) int32.
        full_kv_num_blocks, full_kv_indices: the full ones.
        q_num_blocks, q_indices, full_q_num_blocks, full_q_indices: transposed, per kv block (for dK/dV).
        analytic: the `DocBand` rule of partial tiles, or None.
        tiles, tile_ids: stored partial tiles (n, bs, bs) bool and (Bm, Hm, nQ, nK) int32 (-1: none), or None.

    The kernels (and the ``torch.ops.longctx.triton_sparse_*`` ops, which cannot take this object) read it as
    `kernel_tensors` and `kernel_meta`: a fixed list of tensors and a list of ints.
    """

    def __init__(
        self,
        block_kind: torch.Tensor,
        *,
        block_size: int,
        seq_len_q: int,
        seq_len_kv: int,
        analytic: DocBand | None = None,
        tiles: torch.Tensor | None = None,
        tile_ids: torch.Tensor | None = None,
        mask_mod: Callable | None = None,
        source: str = "",
        doc_tensors: tuple[torch.Tensor, ...] | None = None,
    ):
        assert block_kind.dim() == 4 and block_kind.dtype == torch.int8
        self.block_kind = block_kind
        self.block_size = block_size
        self.seq_len_q = seq_len_q
        self.seq_len_kv = seq_len_kv
        self.analytic = analytic
        self.tiles = tiles
        self.tile_ids = tile_ids
        self.mask_mod = mask_mod
        self.source = source
        self._doc_tensors = doc_tensors
        self._cpu_cache = None
        full = block_kind == FULL
        part = block_kind == PARTIAL
        self.full_kv_num_blocks, self.full_kv_indices = _lists(full)
        self.kv_num_blocks, self.kv_indices = _lists(part)
        self.full_q_num_blocks, self.full_q_indices = _lists(full.transpose(-1, -2))
        self.q_num_blocks, self.q_indices = _lists(part.transpose(-1, -2))
        # built here, not on first use, so that torch.compile only reads them (no side effect to trace)
        self._intervals = None if analytic is None else analytic.intervals(seq_len_q, seq_len_kv, self.device)
        self._kernel_tensors = self._make_kernel_tensors()

    # -- construction --

    @classmethod
    def from_layout(
        cls,
        layout: torch.Tensor,
        block_size: int,
        seq_len_q: int | None = None,
        seq_len_kv: int | None = None,
    ) -> BlockMask:
        """The FlashAttention paper's block-sparse form: every element of a kept block is visible.

        Args:
            layout: bool (nQ, nK), (H or 1, nQ, nK) or (B or 1, H or 1, nQ, nK); True keeps the block.
            block_size: entries per block side.
            seq_len_q, seq_len_kv: default ``nQ * block_size`` and ``nK * block_size``; shorter lengths cut
                the last block.
        """
        _check_pos_int("block_size", block_size, 1)
        if not isinstance(layout, torch.Tensor) or layout.dim() not in (2, 3, 4):
            raise ValueError("layout must be a bool tensor of shape (nQ, nK), (H, nQ, nK) or (B, H, nQ, nK)")
        lay = layout.to(torch.bool)
        while lay.dim() < 4:
            lay = lay.unsqueeze(0)
        nq, nk = lay.shape[-2:]
        sq = nq * block_size if seq_len_q is None else seq_len_q
        sk = nk * block_size if seq_len_kv is None else seq_len_kv
        if math.ceil(sq / block_size) != nq or math.ceil(sk / block_size) != nk:
            raise ValueError(
                f"layout has {nq} x {nk} blocks of {block_size}, which does not match seq_len_q={sq}, "
                f"seq_len_kv={sk} (expected ceil(S / block_size) blocks per side)"
            )
        kind = (lay.to(torch.int8) * FULL).contiguous()
        return cls(kind, block_size=block_size, seq_len_q=sq, seq_len_kv=sk, source="layout")

    # -- facts --

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.block_kind.shape[0], self.block_kind.shape[1], self.seq_len_q, self.seq_len_kv)

    @property
    def device(self) -> torch.device:
        return self.block_kind.device

    @property
    def num_blocks(self) -> tuple[int, int]:
        return self.block_kind.shape[-2], self.block_kind.shape[-1]

    def _valid_counts(self) -> torch.Tensor:
        """(nQ, nK) number of in-range entries of each block (the last blocks may be cut)."""
        bs = self.block_size
        nq, nk = self.num_blocks
        vq = (self.seq_len_q - torch.arange(nq, device=self.device) * bs).clamp(max=bs)
        vk = (self.seq_len_kv - torch.arange(nk, device=self.device) * bs).clamp(max=bs)
        return vq[:, None] * vk[None, :]

    def block_density(self) -> float:
        """Fraction of the blocks that are computed (full or partial)."""
        return float((self.block_kind != EMPTY).float().mean())

    @property
    def sparsity(self) -> float:
        """Percentage of blocks skipped (FlexAttention's ``BlockMask.sparsity()`` as a property)."""
        return 100.0 * (1.0 - self.block_density())

    def kept_fraction(self) -> float:
        """Fraction of the (Bm, Hm, Sq, Sk) score entries that are visible (exact)."""
        total = self.block_kind.shape[0] * self.block_kind.shape[1] * self.seq_len_q * self.seq_len_kv
        if total == 0:
            return 0.0
        kept = float((self.block_kind == FULL).to(torch.int64).mul(self._valid_counts()).sum())
        sel = (self.block_kind == PARTIAL).nonzero()
        for start in range(0, sel.shape[0], 8192):
            s = sel[start : start + 8192]
            kept += float(self._partial_tiles(s[:, 0], s[:, 1], s[:, 2], s[:, 3]).sum())
        return kept / total

    def __repr__(self) -> str:
        bm, hm, nq, nk = self.block_kind.shape
        n_full = int((self.block_kind == FULL).sum())
        n_part = int((self.block_kind == PARTIAL).sum())
        total = bm * hm * nq * nk
        how = "analytic" if self.analytic is not None else ("tiles" if self.tiles is not None else "none")
        lines = [
            f"BlockMask(shape=(B={bm}, H={hm}, Sq={self.seq_len_q}, Sk={self.seq_len_kv}), "
            f"block_size={self.block_size}, blocks={nq}x{nk}, full={n_full}, partial={n_part}, "
            f"empty={total - n_full - n_part}, sparsity={self.sparsity:.2f}%, partial_mask={how}, "
            f"source={self.source or '?'}, device={self.device})"
        ]
        if nq <= 16 and nk <= 16:
            glyph = {EMPTY: ".", FULL: "#", PARTIAL: "+"}
            for r in self.block_kind[0, 0].tolist():
                lines.append("  " + " ".join(glyph[x] for x in r))
        return "\n".join(lines)

    # -- what the kernels read --

    def _make_kernel_tensors(self) -> tuple[torch.Tensor, ...]:
        dev = self.device
        i32 = lambda *shape: torch.zeros(shape, dtype=torch.int32, device=dev)  # noqa: E731
        if self._intervals is not None:
            docs = self._intervals
        else:
            docs = self.doc_tensors() if self.analytic is not None else (i32(1, 1),) * 4
        if self.tiles is not None:
            tiles, tile_ids = self.tiles.contiguous().view(torch.uint8), self.tile_ids
        else:
            tiles, tile_ids = torch.zeros(1, dtype=torch.uint8, device=dev), i32(1, 1, 1, 1)
        return (
            self.kv_num_blocks,
            self.kv_indices,
            self.full_kv_num_blocks,
            self.full_kv_indices,
            self.q_num_blocks,
            self.q_indices,
            self.full_q_num_blocks,
            self.full_q_indices,
            *docs,
            tiles,
            tile_ids,
        )

    def kernel_tensors(self) -> tuple[torch.Tensor, ...]:
        """The 14 tensors the Triton kernels read, in this order: ``kv_num_blocks, kv_indices,
        full_kv_num_blocks, full_kv_indices, q_num_blocks, q_indices, full_q_num_blocks, full_q_indices``, the
        analytic rule's ``q_doc, k_doc, q_pos, k_pos`` (int32 (Bd, S); (1, 1) zeros without a rule) or, where the
        rule is one (`DocBand.intervals`), its ``row_lo, col_lo, row_hi, col_hi`` in their places, the stored
        partial tiles as uint8 (n, bs, bs) and ``tile_ids`` (zeros without stored tiles)."""
        return self._kernel_tensors

    def kernel_meta(self) -> list[int]:
        """The ints that go with `kernel_tensors`: ``[block_size, seq_len_q, seq_len_kv, mask_kind, lo, hi,
        kv_global, q_global, has_doc]``; mask_kind 0 layout (full blocks only), 1 analytic rule, 2 stored tiles,
        3 the analytic rule as per-token intervals."""
        kind, lo, hi, kvg, qg, has_doc = 0, 0, 0, 0, 0, 0
        if self._intervals is not None:
            kind, has_doc = 3, int(self.analytic.has_doc)
        elif self.analytic is not None:
            rule = self.analytic
            kind, (lo, hi), kvg, qg, has_doc = 1, rule.bounds(), rule.kv_global, rule.q_global, int(rule.has_doc)
        elif self.tiles is not None:
            kind = 2
        return [self.block_size, self.seq_len_q, self.seq_len_kv, kind, lo, hi, kvg, qg, has_doc]

    # -- element masks --

    def doc_tensors(self) -> tuple[torch.Tensor, ...]:
        """(q_doc, k_doc, q_pos, k_pos) int32 (Bd, S) on the mask's device (analytic masks only)."""
        assert self.analytic is not None
        if self._doc_tensors is None or self._doc_tensors[0].device != self.device:
            self._doc_tensors = self.analytic.tensors(self.seq_len_q, self.seq_len_kv, self.device)
        return self._doc_tensors

    def _partial_tiles(self, b, h, qb, kb) -> torch.Tensor:
        """(n, bs, bs) element masks of the listed blocks (False outside the sequences)."""
        bs = self.block_size
        ar = torch.arange(bs, device=self.device)
        qi = qb[:, None].to(torch.int64) * bs + ar  # (n, bs)
        kj = kb[:, None].to(torch.int64) * bs + ar
        valid = (qi < self.seq_len_q)[:, :, None] & (kj < self.seq_len_kv)[:, None, :]
        if self.analytic is not None:
            return _rule_tiles(self.analytic, self.doc_tensors(), b, qi, kj, self.seq_len_q, self.seq_len_kv) & valid
        if self.tiles is not None:
            ids = self.tile_ids[b, h, qb, kb].to(torch.int64)
            return self.tiles[ids] & valid
        # a layout mask has no partial blocks
        return valid

    def tile_mask(self, b: int, h: int, qb: int, kb: int) -> torch.Tensor:
        """Element mask (bs, bs) of one block (batch/head indices of the mask, already broadcast)."""
        ix = torch.tensor([b, h, qb, kb], device=self.device)
        return self._partial_tiles(ix[0:1], ix[1:2], ix[2:3], ix[3:4])[0]

    def dense_mask(self, device: torch.device | str | None = None) -> torch.Tensor:
        """The whole (Bm, Hm, Sq, Sk) bool mask, True where visible (memory quadratic: for tests/reference)."""
        bm, hm, nq, nk = self.block_kind.shape
        bs = self.block_size
        full = self.block_kind == FULL
        dense = full[:, :, :, None, :, None].expand(bm, hm, nq, bs, nk, bs).clone()
        sel = (self.block_kind == PARTIAL).nonzero()
        if sel.shape[0]:
            tiles = self._partial_tiles(sel[:, 0], sel[:, 1], sel[:, 2], sel[:, 3])
            dense[sel[:, 0], sel[:, 1], sel[:, 2], :, sel[:, 3], :] = tiles
        dense = dense.reshape(bm, hm, nq * bs, nk * bs)[:, :, : self.seq_len_q, : self.seq_len_kv]
        return dense.to(device if device is not None else self.device)

    # -- use --

    def check_compatible(self, q: torch.Tensor, k: torch.Tensor) -> None:
        """Raise ValueError unless this mask fits q (B, Hq, Sq, D) and k (B, Hkv, Sk, D)."""
        B, Hq, Sq = q.shape[0], q.shape[1], q.shape[2]
        Sk = k.shape[2]
        bm, hm = self.block_kind.shape[:2]
        if Sq != self.seq_len_q or Sk != self.seq_len_kv:
            raise ValueError(
                f"block_mask was built for Sq={self.seq_len_q}, Sk={self.seq_len_kv} but q has Sq={Sq} and k has "
                f"Sk={Sk}; rebuild it with longctx.block_mask(mask_mod, B, H, {Sq}, {Sk})"
            )
        if bm not in (1, B):
            raise ValueError(f"block_mask has batch size {bm}, expected 1 (broadcast) or {B} (q's batch)")
        if hm not in (1, Hq):
            raise ValueError(
                f"block_mask has {hm} heads, expected 1 (broadcast) or {Hq} (the number of query heads; masks "
                "are per query head, also under GQA)"
            )
        if self.device != q.device:
            raise ValueError(
                f"block_mask is on {self.device} but q is on {q.device}; build it with device=q.device or "
                "call bm.to(q.device)"
            )

    def to(self, device: torch.device | str) -> BlockMask:
        """A copy of this mask on ``device`` (self when it is already there)."""
        device = torch.device(device)
        if device == self.device:
            return self
        ana = self.analytic
        return BlockMask(
            self.block_kind.to(device),
            block_size=self.block_size,
            seq_len_q=self.seq_len_q,
            seq_len_kv=self.seq_len_kv,
            analytic=ana,
            tiles=None if self.tiles is None else self.tiles.to(device),
            tile_ids=None if self.tile_ids is None else self.tile_ids.to(device),
            mask_mod=self.mask_mod,
            source=self.source,
        )

    def cpu_lists(self) -> dict[str, list]:
        """The block lists as nested Python lists (for the plain-PyTorch tiled path)."""
        if self._cpu_cache is None:
            names = [
                "kv_num_blocks",
                "kv_indices",
                "full_kv_num_blocks",
                "full_kv_indices",
                "q_num_blocks",
                "q_indices",
                "full_q_num_blocks",
                "full_q_indices",
            ]
            self._cpu_cache = {n: getattr(self, n).tolist() for n in names}
        return self._cpu_cache


# ----------------------------------------------------------------------------------------------------------
# Builders
# ----------------------------------------------------------------------------------------------------------


def _rule_tiles(rule: DocBand, tensors, b, qi, kj, sq: int, sk: int) -> torch.Tensor:
    """The analytic rule on n tiles: b (n,), qi (n, bs), kj (n, bs) absolute indices -> (n, bs, bs)."""
    qd, kd, qp, kp = tensors
    bd = b.clamp(max=qd.shape[0] - 1).to(torch.int64)[:, None]
    qic = qi.clamp(max=sq - 1)
    kjc = kj.clamp(max=sk - 1)
    return rule.visible(
        qd[bd, qic][:, :, None],
        kd[bd, kjc][:, None, :],
        qp[bd, qic][:, :, None],
        kp[bd, kjc][:, None, :],
        qi[:, :, None],
        kj[:, None, :],
    )


def _block_minmax(t: torch.Tensor, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block of the last dim of an int (Bd, S) tensor: min and max (the cut last block included)."""
    bd, s = t.shape
    nb = -(-s // bs)
    pad = nb * bs - s
    if pad:
        t = torch.cat([t, t[:, -1:].expand(bd, pad)], dim=1)  # repeat the last entry: min/max unchanged
    t = t.view(bd, nb, bs)
    return t.amin(-1).to(torch.int64), t.amax(-1).to(torch.int64)


def _build_analytic(rule: DocBand, sq: int, sk: int, bs: int, device, mask_mod, name) -> BlockMask:
    qd, kd, qp, kp = rule.tensors(sq, sk, device)
    nq, nk = -(-sq // bs), -(-sk // bs)
    lo, hi = rule.bounds()
    qdmin, qdmax = _block_minmax(qd, bs)
    kdmin, kdmax = _block_minmax(kd, bs)
    qpmin, qpmax = _block_minmax(qp, bs)
    kpmin, kpmax = _block_minmax(kp, bs)
    # (Bd, nQ, nK) from (Bd, nQ) and (Bd, nK)
    Q = lambda t: t[:, :, None]
    K = lambda t: t[:, None, :]
    qi_lo = torch.arange(nq, device=device, dtype=torch.int64) * bs
    qi_hi = (qi_lo + bs - 1).clamp(max=sq - 1)
    kj_lo = torch.arange(nk, device=device, dtype=torch.int64) * bs
    kj_hi = (kj_lo + bs - 1).clamp(max=sk - 1)
    # -- may the block hold a visible entry? (conservative) --
    cand = (K(kpmax) - Q(qpmin) >= lo) & (K(kpmin) - Q(qpmax) <= hi)
    if rule.has_doc:
        cand &= (Q(qdmin) <= K(kdmax)) & (K(kdmin) <= Q(qdmax))
    # -- is every entry visible? (exact sufficient condition) --
    full = (K(kpmin) - Q(qpmax) >= lo) & (K(kpmax) - Q(qpmin) <= hi)
    if rule.has_doc:
        full &= (Q(qdmin) == Q(qdmax)) & (K(kdmin) == K(kdmax)) & (Q(qdmin) == K(kdmin))
    glob = torch.zeros(1, nq, nk, dtype=torch.bool, device=device)
    if rule.kv_global > 0:
        glob = glob | (kj_lo < rule.kv_global)[None, None, :]  # some column is global: visible entries
        full |= (kj_hi < rule.kv_global)[None, None, :]
    if rule.q_global > 0:
        glob = glob | (qi_lo < rule.q_global)[None, :, None]
        full |= (qi_hi < rule.q_global)[None, :, None]
    cand = cand | glob
    kind = torch.where(full, FULL, torch.where(cand, PARTIAL, EMPTY)).to(torch.int8)
    # -- refine the candidates exactly on their elements: some are empty or in fact full --
    sel = (kind == PARTIAL).nonzero()
    if sel.shape[0]:
        ar = torch.arange(bs, device=device)
        vq = (sq - torch.arange(nq, device=device) * bs).clamp(max=bs)
        vk = (sk - torch.arange(nk, device=device) * bs).clamp(max=bs)
        counts = []
        for start in range(0, sel.shape[0], 4096):
            s = sel[start : start + 4096]
            qi = s[:, 1:2] * bs + ar  # (n, bs)
            kj = s[:, 2:3] * bs + ar
            valid = (qi < sq)[:, :, None] & (kj < sk)[:, None, :]
            vis = _rule_tiles(rule, (qd, kd, qp, kp), s[:, 0], qi, kj, sq, sk) & valid
            counts.append(vis.sum((1, 2)))
        cnt = torch.cat(counts)
        full_cnt = vq[sel[:, 1]] * vk[sel[:, 2]]
        new = torch.where(cnt == 0, EMPTY, torch.where(cnt == full_cnt, FULL, PARTIAL))
        kind[sel[:, 0], sel[:, 1], sel[:, 2]] = new.to(torch.int8)
    bm = BlockMask(
        kind.unsqueeze(1).contiguous(),
        block_size=bs,
        seq_len_q=sq,
        seq_len_kv=sk,
        analytic=rule,
        mask_mod=mask_mod,
        source=name,
        doc_tensors=(qd, kd, qp, kp),
    )
    return bm


def _build_general(mask_mod, B, H, sq, sk, bs, device, name) -> BlockMask:
    bm_, hm_ = (1 if B is None else B), (1 if H is None else H)
    nq, nk = -(-sq // bs), -(-sk // bs)
    kind = torch.zeros(bm_, hm_, nq, nk, dtype=torch.int8, device=device)
    tile_ids = torch.full((bm_, hm_, nq, nk), -1, dtype=torch.int32, device=device)
    tiles: list[torch.Tensor] = []
    n_tiles = 0
    skp = nk * bs
    budget = (1 << 27) if device.type == "cuda" else (1 << 24)
    rows = max(bs, (budget // skp) // bs * bs)
    kj = torch.arange(skp, device=device)
    kj_eval = kj.clamp(max=max(sk - 1, 0))[None, :]
    kvalid = (kj < sk)[None, :]
    vq_all = (sq - torch.arange(nq, device=device) * bs).clamp(max=bs)
    vk = (sk - torch.arange(nk, device=device) * bs).clamp(max=bs)
    for b in range(bm_):
        for h in range(hm_):
            tb = torch.tensor(b, device=device)
            th = torch.tensor(h, device=device)
            for r0 in range(0, nq * bs, rows):
                r1 = min(r0 + rows, nq * bs)
                qi = torch.arange(r0, r1, device=device)[:, None]
                m = mask_mod(tb, th, qi.clamp(max=max(sq - 1, 0)), kj_eval)
                if not isinstance(m, torch.Tensor) or m.dtype != torch.bool:
                    raise TypeError(
                        f"mask_mod must return a bool tensor, got "
                        f"{type(m).__name__ if not isinstance(m, torch.Tensor) else m.dtype}"
                    )
                m = m.expand(r1 - r0, skp) & (qi < sq) & kvalid
                nqc = (r1 - r0) // bs
                m4 = m.reshape(nqc, bs, nk, bs)
                cnt = m4.sum((1, 3), dtype=torch.int32)  # (nqc, nK)
                valid = vq_all[r0 // bs : r0 // bs + nqc, None] * vk[None, :]
                k_ = torch.where(cnt == 0, EMPTY, torch.where(cnt == valid, FULL, PARTIAL)).to(torch.int8)
                kind[b, h, r0 // bs : r0 // bs + nqc] = k_
                part = (k_ == PARTIAL).nonzero()
                if part.shape[0]:
                    tiles.append(m4.permute(0, 2, 1, 3)[part[:, 0], part[:, 1]].contiguous())
                    ids = torch.arange(n_tiles, n_tiles + part.shape[0], device=device, dtype=torch.int32)
                    tile_ids[b, h, r0 // bs + part[:, 0], part[:, 1]] = ids
                    n_tiles += part.shape[0]
    t = torch.cat(tiles) if tiles else torch.zeros(1, bs, bs, dtype=torch.bool, device=device)
    return BlockMask(
        kind,
        block_size=bs,
        seq_len_q=sq,
        seq_len_kv=sk,
        tiles=t,
        tile_ids=tile_ids,
        mask_mod=mask_mod,
        source=name,
    )


def block_mask(
    mask_mod: Callable,
    B: int | None,
    H: int | None,
    Sq: int,
    Sk: int,
    block_size: int = 128,
    device: torch.device | str | None = None,
) -> BlockMask:
    """Build a `BlockMask` from a FlexAttention-style ``mask_mod`` (``create_block_mask``'s contract).

    Args:
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor``, True where query ``q_idx`` may see key
            ``kv_idx`` (absolute indices). It is called with 0-dim ``b``, ``h`` and broadcastable index tensors
            ``q_idx`` (n, 1), ``kv_idx`` (1, m), so elementwise tensor code works; Python control flow on the
            arguments does not. Ready-made: `causal_mask`, `sliding_window_mask`, `document_mask`,
            `prefix_lm_mask`, `local_global_mask`, combined with ``&`` (fast analytic path).
        B, H: batch size and number of query heads the mask depends on; None broadcasts (size 1).
        Sq, Sk: sequence lengths of queries and keys.
        block_size: rows/columns per block (kernels tile inside it; 128 is the default as in FlexAttention).
        device: where the mask lives (default: cuda if available, else cpu); it must match q's device.

    Returns:
        a `BlockMask`.

    Raises:
        TypeError/ValueError: a non-callable mask_mod, bad sizes, or a mask_mod returning a non-bool result.
    """
    if not callable(mask_mod):
        raise TypeError(f"mask_mod must be callable (b, h, q_idx, kv_idx) -> bool tensor, got {type(mask_mod)}")
    for nm, val in (("B", B), ("H", H)):
        if val is not None:
            _check_pos_int(nm, val, 1)
    _check_pos_int("Sq", Sq, 1)
    _check_pos_int("Sk", Sk, 1)
    _check_pos_int("block_size", block_size, 1)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    analytic = getattr(mask_mod, "analytic", None)
    name = repr(mask_mod) if isinstance(mask_mod, MaskMod) else getattr(mask_mod, "__name__", "mask_mod")
    if analytic is not None:
        bd = analytic.batch()
        if B is not None and bd not in (1, B):
            raise ValueError(f"the mask's per-token tensors have batch {bd}, but B={B}")
        return _build_analytic(analytic, Sq, Sk, block_size, device, mask_mod, name)
    return _build_general(mask_mod, B, H, Sq, Sk, block_size, device, name)
