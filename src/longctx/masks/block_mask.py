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

    bm = longctx.block_mask(longctx.masks.causal_mask, None, None, S, S, device="cuda")
    out = longctx.attention(q, k, v, block_mask=bm)
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from longctx.masks.mask_mods import DocBand, _check_pos_int, _rule_tiles

EMPTY, FULL, PARTIAL = 0, 1, 2

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
