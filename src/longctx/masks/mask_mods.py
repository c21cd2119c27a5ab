"""mask_mod algebra and the ready-made masks (FlexAttention's ``mask_mod(b, h, q_idx, kv_idx) -> bool`` contract).

The ready-made masks carry an analytic rule, `DocBand`, that the block-mask builders classify in O(blocks) and the
kernels re-evaluate in registers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = [
    "DocBand",
    "MaskMod",
    "and_masks",
    "or_masks",
    "causal_mask",
    "sliding_window_mask",
    "document_mask",
    "prefix_lm_mask",
    "local_global_mask",
    "full_mask",
]

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
