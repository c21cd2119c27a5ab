"""Mask descriptions shared by every backend.

Causal and sliding-window masks are both *bands* around a diagonal of the score matrix. Every backend
(math, tiled, Triton, the peer adapters, context parallelism) receives the same `Band`, so the rule
"query i may see key j" is written once, here:

    key j is visible to query i  <=>  lo <= j - i <= hi        (a bound of None is unbounded)

`Band.from_args` turns the public arguments into a band. Causal masking is aligned to the bottom-right
corner, as in FlashAttention: with ``offset = Sk - Sq`` the last query sees the last key.

    Sq = 2, Sk = 5, causal          Sq = 5, Sk = 2, causal
        k0 k1 k2 k3 k4                  k0 k1
    q0   x  x  x  x  .              q0   .  .     (rows 0..2 see nothing:
    q1   x  x  x  x  x              q1   .  .      output 0, lse -inf)
                                    q2   .  .
                                    q3   x  .
                                    q4   x  x

PyTorch SDPA's `is_causal` aligns top-left instead (query i sees keys j <= i); the two agree only when
Sq == Sk.

A window ``(left, right)`` (FlashAttention's ``window_size``; -1 means unbounded on that side) lets query i
see keys ``i + offset - left <= j <= i + offset + right``. The public functions read it as flash-attn's kernels do
(`flash_window`): a side of Sk or more is unbounded, and with ``causal=True`` the right side is 0, whatever was
passed (transformers' flash-attention path passes ``(w - 1, w - 1)`` with ``causal=True`` for sliding windows).

Context parallelism reuses the same band with a shifted diagonal: a query chunk that starts at global
position ``qs`` attending a key chunk at ``ks`` sees ``lo - (qs - ks) <= j - i <= hi - (qs - ks)`` in
local indices (`Band.shifted`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

__all__ = ["Band", "TileKind", "flash_window", "normalize_window"]


class TileKind(Enum):
    """How a (query tile, key tile) pair of the score matrix meets a mask."""

    EMPTY = 0  # every entry masked: the tile is skipped
    FULL = 1  # every entry visible: no per-element mask needed
    PARTIAL = 2  # a boundary tile: the mask is applied per element


def normalize_window(window: tuple[int, int] | list[int] | None) -> tuple[int, int]:
    """Validate a ``(left, right)`` window and return it as a tuple; None means ``(-1, -1)``."""
    if window is None:
        return (-1, -1)
    if isinstance(window, (str, bytes)) or not hasattr(window, "__len__") or len(window) != 2:
        raise ValueError(
            f"window must be a pair (left, right) of ints >= -1 (-1 = unbounded), got {window!r}; "
            "for a causal sliding window of W keys use causal=True, window=(W - 1, 0)"
        )
    left, right = window
    for name, val in (("left", left), ("right", right)):
        if isinstance(val, bool) or not isinstance(val, int):
            if isinstance(val, torch.Tensor) and val.numel() == 1 and not val.is_floating_point():
                continue
            raise TypeError(f"window {name} must be an int, got {type(val).__name__} ({val!r})")
        if val < -1:
            raise ValueError(
                f"window {name} must be >= -1 (-1 means unbounded on that side), got {val}; window={tuple(window)!r}"
            )
    return (int(left), int(right))


def flash_window(window: tuple[int, int] | list[int] | None, *, causal: bool, seqlen_k: int) -> tuple[int, int]:
    """flash-attn's ``window_size`` as its kernels apply it: ``(left, right)`` with -1 for an unbounded side.

    A side of ``seqlen_k`` or more is unbounded (-1), then ``causal=True`` sets the right side to 0, as
    flash-attn 2.x's ``mha_fwd`` / ``mha_varlen_fwd`` do (the varlen forms compare with ``max_seqlen_k``). Only the
    right side's bound changes a result, and only where Sq > Sk: with ``right >= Sk`` the first queries see every key
    instead of none.

    Raises:
        ValueError / TypeError: as `normalize_window`.
    """
    left, right = normalize_window(window)
    if left >= seqlen_k:
        left = -1
    if right >= seqlen_k:
        right = -1
    if causal:
        right = 0
    return left, right


@dataclass(frozen=True)
class Band:
    """Key j is visible to query i iff ``lo <= j - i <= hi``; None is unbounded on that side."""

    lo: int | None = None
    hi: int | None = None

    @classmethod
    def from_args(cls, sq: int, sk: int, causal: bool = False, window: tuple[int, int] | None = None) -> Band:
        """The band of ``longctx.attention(causal=..., window=...)`` for Sq queries and Sk keys."""
        left, right = normalize_window(window)
        offset = sk - sq
        lo = offset - left if left >= 0 else None
        hi = offset + right if right >= 0 else None
        if causal:
            hi = offset
        return cls(lo, hi)

    def within(self, sq: int, sk: int) -> Band:
        """The same mask of Sq queries and Sk keys with the sides it never reaches unbounded: ``j - i`` lies in
        ``[-(Sq - 1), Sk - 1]``, so a lower side at or below the first or an upper side at or above the second
        masks nothing (a window as wide as the sequence is no window; a causal single query sees every key).
        Only for a call's own Sq and Sk, not for a band shifted to another block's offsets."""
        if sq <= 0 or sk <= 0 or self.is_empty:
            return self
        lo = None if self.lo is not None and self.lo <= -(sq - 1) else self.lo
        hi = None if self.hi is not None and self.hi >= sk - 1 else self.hi
        return self if (lo, hi) == (self.lo, self.hi) else Band(lo, hi)

    @property
    def is_dense(self) -> bool:
        return self.lo is None and self.hi is None

    @property
    def is_empty(self) -> bool:
        """True when no key is visible to any query (lo > hi)."""
        return self.lo is not None and self.hi is not None and self.lo > self.hi

    @property
    def is_causal_like(self) -> bool:
        """True when the band has an upper bound (the mask removes the top-right part)."""
        return self.hi is not None

    def shifted(self, delta: int) -> Band:
        """The band seen in local indices when query index 0 sits ``delta`` positions after key index 0.

        With global positions ``gi = qs + i`` and ``gj = ks + j`` and ``delta = qs - ks``:
        ``lo <= gj - gi <= hi``  <=>  ``lo + delta <= j - i <= hi + delta``.
        """
        return Band(
            None if self.lo is None else self.lo + delta,
            None if self.hi is None else self.hi + delta,
        )

    # -- the same rule at three granularities: element, tile, whole matrix --

    def tile_kind(self, q_start: int, q_end: int, k_start: int, k_end: int) -> TileKind:
        """Classify the tile of queries [q_start, q_end) x keys [k_start, k_end) (both non-empty)."""
        dmin = k_start - (q_end - 1)  # smallest j - i in the tile
        dmax = (k_end - 1) - q_start  # largest j - i in the tile
        if (self.hi is not None and dmin > self.hi) or (self.lo is not None and dmax < self.lo) or self.is_empty:
            return TileKind.EMPTY
        if (self.hi is None or dmax <= self.hi) and (self.lo is None or dmin >= self.lo):
            return TileKind.FULL
        return TileKind.PARTIAL

    def key_range(self, q_start: int, q_end: int, sk: int) -> tuple[int, int]:
        """Keys [start, end) that any query of [q_start, q_end) may see (clamped to [0, sk])."""
        start = 0 if self.lo is None else max(0, q_start + self.lo)
        end = sk if self.hi is None else min(sk, q_end - 1 + self.hi + 1)
        return start, max(start, end)

    def query_range(self, k_start: int, k_end: int, sq: int) -> tuple[int, int]:
        """Queries [start, end) that may see any key of [k_start, k_end) (clamped to [0, sq])."""
        start = 0 if self.hi is None else max(0, k_start - self.hi)
        end = sq if self.lo is None else min(sq, k_end - 1 - self.lo + 1)
        return start, max(start, end)

    def mask(
        self,
        q_start: int,
        q_end: int,
        k_start: int,
        k_end: int,
        device: torch.device | str | None = None,
    ) -> torch.Tensor | None:
        """Boolean (q_end - q_start, k_end - k_start) tensor, True where visible; None if nothing is masked."""
        if self.is_dense:
            return None
        i = torch.arange(q_start, q_end, device=device)[:, None]
        j = torch.arange(k_start, k_end, device=device)[None, :]
        d = j - i
        keep = torch.ones_like(d, dtype=torch.bool)
        if self.lo is not None:
            keep &= d >= self.lo
        if self.hi is not None:
            keep &= d <= self.hi
        return keep

    def dense_mask(self, sq: int, sk: int, device: torch.device | str | None = None) -> torch.Tensor:
        """The whole (Sq, Sk) boolean mask, True where visible."""
        m = self.mask(0, sq, 0, sk, device)
        return torch.ones(sq, sk, dtype=torch.bool, device=device) if m is None else m

    def kept_fraction(self, sq: int, sk: int) -> float:
        """Fraction of the Sq x Sk score entries the band keeps (exact, in O(Sq))."""
        if sq == 0 or sk == 0:
            return 0.0
        i = torch.arange(sq, dtype=torch.int64)
        lo = torch.zeros_like(i) if self.lo is None else (i + self.lo).clamp(0, sk)
        hi = torch.full_like(i, sk) if self.hi is None else (i + self.hi + 1).clamp(0, sk)
        return float((hi - lo).clamp_min(0).sum()) / (sq * sk)
