"""The mask catalogue: named attention masks of long-context training, shared by the benchmark and the tests.

Each generator takes the sequence length ``S`` (queries and keys, self-attention) and its parameters and returns a
`MaskCase` that carries the mask in every form a consumer needs:

- ``mask_mod``: FlexAttention's ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (absolute indices), with longctx's
  analytic rule (`DocBand`) attached wherever the mask has one, so `longctx.block_mask` classifies it in
  O(blocks);
- ``band``: the `Band` of ``longctx.attention(causal=..., window=...)`` for the masks that are one (full, causal,
  sliding windows), None otherwise; ``attention_kwargs()`` gives the matching ``causal``/``window`` arguments;
- ``layout``: the block layout of the random block-sparse masks (``BlockMask.from_layout``), None otherwise;
- ``block_mask(device)``: the `BlockMask` longctx's kernels read;
- ``dense()``: the (S, S) bool matrix, built from the mask's definition (documents, segments, blocks) by a code
  path separate from the ``mask_mod``, so tests can check one against the other (memory quadratic: small S);
- ``kept_area()``: the number of visible (query, key) pairs, computed in O(S) without an S x S matrix, the
  ``area`` of the benchmark's FLOP count (forward ``4 * area * Hq * D`` per batch element).

Masks whose documents are drawn at random take a ``seed``; document lengths follow a log-normal law (many short
documents, a long tail), capped at ``cap`` tokens (default ``S // 4``), as in pre-training corpora packed into
long sequences. The catalogue itself is `CATALOGUE` (name -> generator and default parameters); `make_mask` builds
one entry by name::

    from longctx.masks import make_mask, mask_names
    m = make_mask("causal_document", 65536, seed=1, device="cuda")
    bm = m.block_mask()                               # longctx.attention(q, k, v, block_mask=bm)
    flops = 4 * m.kept_area() * Hq * D                # forward FLOPs per batch element
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from longctx.masks.band import Band
from longctx.masks.block_mask import BlockMask
from longctx.masks.build import block_mask as _block_mask
from longctx.masks.mask_mods import (
    DocBand,
    MaskMod,
    causal_mask,
    document_mask,
    full_mask,
    local_global_mask,
    prefix_lm_mask,
    sliding_window_mask,
)

__all__ = [
    "MaskCase",
    "CATALOGUE",
    "SEEDED_MASKS",
    "mask_names",
    "make_mask",
    "doc_lengths",
    "full",
    "causal",
    "sliding_window",
    "causal_sliding_window",
    "document",
    "causal_document",
    "share_question",
    "causal_blockwise",
    "prefix_lm_causal",
    "prefix_lm_document",
    "global_sliding_window",
    "block_causal_document",
    "random_block_sparse",
]


# ----------------------------------------------------------------------------------------------------------
# The case object
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class MaskCase:
    """One mask of the catalogue at one sequence length (see the module docstring for each field's use).

    Attributes:
        name: the catalogue name (``"causal_document"``).
        S: queries = keys.
        params: the parameters it was generated with (``window``, ``seed``, ``density``, ...).
        description: one line for reports.
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool`` over absolute indices.
        band: the `Band` when the mask is one (full, causal, sliding windows), else None.
        layout: (nQ, nK) bool block layout of block-sparse masks, else None.
        block_size: block side of ``layout`` and of ``block_mask()``.
        doc_lengths: lengths of the packed documents (sum S) for the document masks, else None.
        causal: True when no query sees a later key.
    """

    name: str
    S: int
    params: dict
    description: str
    mask_mod: Callable
    dense_fn: Callable[[], torch.Tensor] = field(repr=False)
    area_fn: Callable[[], int] = field(repr=False)
    band: Band | None = None
    layout: torch.Tensor | None = field(default=None, repr=False)
    block_size: int = 128
    doc_lengths: tuple[int, ...] | None = None
    causal: bool = False

    @property
    def label(self) -> str:
        """The name with the seed of seeded masks (``"causal_document/seed1"``)."""
        return f"{self.name}/seed{self.params['seed']}" if "seed" in self.params else self.name

    def dense(self) -> torch.Tensor:
        """(S, S) bool on the CPU, True where query i sees key j (quadratic memory: tests and small S)."""
        return self.dense_fn()

    def kept_area(self) -> int:
        """Visible (query, key) pairs, exact, in O(S)."""
        return int(self.area_fn())

    def kept_fraction(self) -> float:
        return self.kept_area() / float(self.S * self.S)

    def attention_kwargs(self) -> dict:
        """``causal``/``window`` arguments of ``longctx.attention`` for a band mask (ValueError otherwise)."""
        if self.band is None:
            raise ValueError(f"mask {self.name!r} is not a band (causal / window); pass block_mask=case.block_mask()")
        lo, hi = self.band.lo, self.band.hi
        if hi == 0 and lo is None:
            return {"causal": True}
        if hi == 0:
            return {"causal": True, "window": (-lo, 0)}
        if lo is None and hi is None:
            return {}
        return {"window": (-1 if lo is None else -lo, -1 if hi is None else hi)}

    def block_mask(self, device: torch.device | str | None = "cpu") -> BlockMask:
        """longctx's `BlockMask` of this mask on ``device`` (None: cuda if available)."""
        if self.layout is not None:
            return BlockMask.from_layout(self.layout.to(device or _default_device()), self.block_size, self.S, self.S)
        return _block_mask(self.mask_mod, None, None, self.S, self.S, block_size=self.block_size, device=device)


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


# ----------------------------------------------------------------------------------------------------------
# Checks and shared pieces
# ----------------------------------------------------------------------------------------------------------


def _check_int(name: str, val, minimum: int) -> int:
    if isinstance(val, bool) or not isinstance(val, int):
        raise TypeError(f"{name} must be an int, got {type(val).__name__} ({val!r})")
    if val < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {val}")
    return val


def _check_fraction(name: str, val, lo_open: bool) -> float:
    if isinstance(val, bool) or not isinstance(val, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(val).__name__} ({val!r})")
    if not (0.0 < val <= 1.0 if lo_open else 0.0 <= val <= 1.0):
        raise ValueError(f"{name} must be in {'(0, 1]' if lo_open else '[0, 1]'}, got {val}")
    return float(val)


def doc_lengths(
    S: int,
    *,
    seed: int = 0,
    cap: int | None = None,
    median: int = 1024,
    sigma: float = 1.2,
) -> tuple[int, ...]:
    """Lengths of documents packed into S tokens, drawn from a long-tailed (log-normal) law.

    Each length is ``round(median * exp(sigma * z))`` for a standard normal z (a CPU generator seeded with
    ``seed``: the same lengths on every machine), clamped to [1, cap]; documents are drawn until they fill S and
    the last one is cut to fit. With the defaults most documents are a few hundred to a few thousand tokens and a
    few reach the cap, as in web text.

    Args:
        S: total tokens (>= 1).
        seed: the generator's seed.
        cap: longest document (default ``max(1, S // 4)``).
        median: median length before the cap.
        sigma: spread of log-lengths (larger: a longer tail).

    Returns:
        the lengths, each >= 1, summing to S.
    """
    S = _check_int("S", S, 1)
    seed = _check_int("seed", seed, 0)
    cap = max(1, S // 4) if cap is None else _check_int("cap", cap, 1)
    median = _check_int("median", median, 1)
    if isinstance(sigma, bool) or not isinstance(sigma, (int, float)) or sigma < 0:
        raise ValueError(f"sigma must be a float >= 0, got {sigma!r}")
    g = torch.Generator().manual_seed(seed)
    out: list[int] = []
    total = 0
    while total < S:
        z = torch.randn(256, generator=g, dtype=torch.float64)
        for x in (median * torch.exp(sigma * z)).round().clamp(1, cap).to(torch.int64).tolist():
            out.append(min(x, S - total))
            total += out[-1]
            if total == S:
                break
    return tuple(out)


def _cap(S: int, cap: int | None) -> int:
    return max(1, S // 4) if cap is None else cap


def _ids_and_offsets(lengths: tuple[int, ...], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token: its document id and the index of its document's first token, int64 (S,)."""
    L = torch.tensor(lengths, dtype=torch.int64)
    starts = torch.cumsum(L, 0) - L
    ids = torch.repeat_interleave(torch.arange(len(lengths)), L)
    return ids.to(device), starts.repeat_interleave(L).to(device)


def _band_area(S: int, lo: int | None, hi: int | None) -> int:
    i = torch.arange(S, dtype=torch.int64)
    a = torch.zeros_like(i) if lo is None else (i + lo).clamp(0, S)
    b = torch.full_like(i, S) if hi is None else (i + hi + 1).clamp(0, S)
    return int((b - a).clamp_min(0).sum())


def _tri(n: int) -> int:
    return n * (n + 1) // 2


def _blocks_dense(lengths, fill: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """Block-diagonal (S, S) bool with ``fill(L)`` (an (L, L) bool) for each document."""
    S = sum(lengths)
    m = torch.zeros(S, S, dtype=torch.bool)
    s = 0
    for L in lengths:
        m[s : s + L, s : s + L] = fill(L)
        s += L
    return m


def _tril(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()


# ----------------------------------------------------------------------------------------------------------
# The generators
# ----------------------------------------------------------------------------------------------------------


def full(S: int, device: torch.device | str = "cpu") -> MaskCase:
    """Every query sees every key (bidirectional attention, no mask)."""
    S = _check_int("S", S, 1)
    return MaskCase(
        "full",
        S,
        {},
        "every key visible",
        full_mask,
        lambda: torch.ones(S, S, dtype=torch.bool),
        lambda: S * S,
        band=Band(),
    )


def causal(S: int, device: torch.device | str = "cpu") -> MaskCase:
    """Query i sees keys j <= i (decoder-only language models)."""
    S = _check_int("S", S, 1)
    return MaskCase(
        "causal", S, {}, "query i sees keys j <= i", causal_mask, lambda: _tril(S), lambda: _tri(S), band=Band(hi=0)
    )


def sliding_window(S: int, window: int = 1024, device: torch.device | str = "cpu") -> MaskCase:
    """Bidirectional sliding window: query i sees keys with ``|i - j| < window``."""
    S, w = _check_int("S", S, 1), _check_int("window", window, 1)

    def mod(b, h, q, kv):
        return (q - kv).abs() < w

    def dense():
        return torch.ones(S, S, dtype=torch.bool).triu(-(w - 1)).tril(w - 1)

    return MaskCase(
        "sliding_window",
        S,
        {"window": w},
        f"|i - j| < {w}",
        MaskMod(mod, DocBand(lo=-(w - 1), hi=w - 1), f"sliding_window_bidir({w})"),
        dense,
        lambda: _band_area(S, -(w - 1), w - 1),
        band=Band(-(w - 1), w - 1),
    )


def causal_sliding_window(S: int, window: int = 1024, device: torch.device | str = "cpu") -> MaskCase:
    """Causal sliding window: query i sees keys ``i - window < j <= i`` (Mistral, Gemma's local layers)."""
    S, w = _check_int("S", S, 1), _check_int("window", window, 1)
    return MaskCase(
        "causal_sliding_window",
        S,
        {"window": w},
        f"i - {w} < j <= i",
        sliding_window_mask(w),
        lambda: _tril(S).triu(-(w - 1)),
        lambda: _band_area(S, -(w - 1), 0),
        band=Band(-(w - 1), 0),
        causal=True,
    )


def _doc_case(name, S, seed, cap, device, causal_: bool, median: int = 1024) -> MaskCase:
    S = _check_int("S", S, 1)
    lengths = doc_lengths(S, seed=seed, cap=cap, median=median)
    ids, _ = _ids_and_offsets(lengths, device)
    mm = document_mask(ids) & causal_mask if causal_ else document_mask(ids)
    fill = _tril if causal_ else (lambda n: torch.ones(n, n, dtype=torch.bool))
    area = sum(_tri(L) if causal_ else L * L for L in lengths)
    what = "causal inside each document" if causal_ else "every token of its own document"
    return MaskCase(
        name,
        S,
        {"seed": seed, "cap": _cap(S, cap), "median": median, "documents": len(lengths), "longest": max(lengths)},
        f"{len(lengths)} packed documents (long-tailed lengths), {what}",
        mm,
        lambda: _blocks_dense(lengths, fill),
        lambda: area,
        doc_lengths=lengths,
        causal=causal_,
    )


def document(
    S: int, seed: int = 0, cap: int | None = None, device: torch.device | str = "cpu", median: int = 1024
) -> MaskCase:
    """Packed documents, bidirectional inside each (encoders): query i sees key j iff they share a document.
    ``cap`` / ``median``: of the lengths (`doc_lengths`)."""
    return _doc_case("document", S, seed, cap, device, False, median)


def causal_document(
    S: int, seed: int = 0, cap: int | None = None, device: torch.device | str = "cpu", median: int = 1024
) -> MaskCase:
    """Packed documents, causal inside each (pre-training with packing): same document and j <= i. ``cap`` /
    ``median``: of the lengths (`doc_lengths`)."""
    return _doc_case("causal_document", S, seed, cap, device, True, median)


def _share_question_segments(L: int, answers: int) -> tuple[int, list[int]]:
    """A document of L tokens as a question (a quarter, at least one token) and up to ``answers`` answers."""
    qn = max(1, L // 4)
    rest = L - qn
    n = min(answers, rest)
    return qn, [rest // n + (1 if a < rest % n else 0) for a in range(n)] if n else []


def share_question(
    S: int, seed: int = 0, cap: int | None = None, answers: int = 4, device: torch.device | str = "cpu"
) -> MaskCase:
    """Shared question (reward models, DPO with several responses): each packed document is a question (its first
    quarter) followed by ``answers`` answers; a token sees, causally, the question of its document and the earlier
    tokens of its own answer, never another answer."""
    S = _check_int("S", S, 1)
    answers = _check_int("answers", answers, 1)
    lengths = doc_lengths(S, seed=seed, cap=cap)
    doc_ids, seg_ids, is_q = [], [], []
    seg = 0
    for d, L in enumerate(lengths):
        qn, ans = _share_question_segments(L, answers)
        for n, question in [(qn, True)] + [(a, False) for a in ans]:
            doc_ids += [d] * n
            seg_ids += [seg] * n
            is_q += [question] * n
            seg += 1
    doc = torch.tensor(doc_ids, dtype=torch.int64, device=device)
    segt = torch.tensor(seg_ids, dtype=torch.int64, device=device)
    isq = torch.tensor(is_q, dtype=torch.bool, device=device)

    def mod(b, h, q, kv):
        return (q >= kv) & ((segt[q] == segt[kv]) | ((doc[q] == doc[kv]) & isq[kv]))

    def dense():
        def fill(L):
            qn, ans = _share_question_segments(L, answers)
            m = torch.zeros(L, L, dtype=torch.bool)
            m[:, :qn] = True
            s = qn
            for a in ans:
                m[s : s + a, s : s + a] = True
                s += a
            return m & _tril(L)

        return _blocks_dense(lengths, fill)

    def area():
        tot = 0
        for L in lengths:
            qn, ans = _share_question_segments(L, answers)
            tot += _tri(qn) + sum(a * qn + _tri(a) for a in ans)
        return tot

    return MaskCase(
        "share_question",
        S,
        {"seed": seed, "cap": _cap(S, cap), "answers": answers, "documents": len(lengths)},
        f"{len(lengths)} documents of a question and up to {answers} answers that share it",
        MaskMod(mod, None, "share_question"),
        dense,
        area,
        doc_lengths=lengths,
        causal=True,
    )


def causal_blockwise(S: int, seed: int = 0, cap: int | None = None, device: torch.device | str = "cpu") -> MaskCase:
    """Causal blockwise (in-context learning with many demonstrations): the sequence is blocks of long-tailed
    lengths; a token of an earlier block sees, causally, its own block only; the last block (the test input) sees
    everything before it, causally."""
    S = _check_int("S", S, 1)
    lengths = doc_lengths(S, seed=seed, cap=cap)
    ids, _ = _ids_and_offsets(lengths, device)
    last = len(lengths) - 1

    def mod(b, h, q, kv):
        return (q >= kv) & ((ids[q] == ids[kv]) | (ids[q] == last))

    def dense():
        m = _blocks_dense(lengths, _tril)
        m[S - lengths[-1] :, :] = True
        return m & _tril(S)

    area = sum(_tri(L) for L in lengths[:-1]) + lengths[-1] * (S - lengths[-1]) + _tri(lengths[-1])
    return MaskCase(
        "causal_blockwise",
        S,
        {"seed": seed, "cap": _cap(S, cap), "blocks": len(lengths)},
        f"{len(lengths)} blocks causal inside each; the last block sees all earlier ones",
        MaskMod(mod, None, "causal_blockwise"),
        dense,
        lambda: area,
        doc_lengths=lengths,
        causal=True,
    )


def _prefix_rows(L: int, p: int) -> int:
    """Visible pairs of a prefix-LM block of L tokens with a bidirectional prefix of p tokens."""
    return p * p + (_tri(L) - _tri(p))


def prefix_lm_causal(S: int, prefix_fraction: float = 0.25, device: torch.device | str = "cpu") -> MaskCase:
    """Prefix-LM (T5 / UL2 / PaliGemma style): the first ``prefix_fraction * S`` tokens see each other
    bidirectionally; every later token sees the whole prefix and, causally, the tokens before it."""
    S = _check_int("S", S, 1)
    frac = _check_fraction("prefix_fraction", prefix_fraction, lo_open=False)
    p = int(S * frac)

    def dense():
        m = _tril(S)
        m[:, :p] = True
        return m

    return MaskCase(
        "prefix_lm_causal",
        S,
        {"prefix": p},
        f"bidirectional prefix of {p} tokens, causal after it",
        prefix_lm_mask(p),
        dense,
        lambda: _prefix_rows(S, p),
        causal=False,
    )


def prefix_lm_document(
    S: int, seed: int = 0, cap: int | None = None, prefix_fraction: float = 0.25, device: torch.device | str = "cpu"
) -> MaskCase:
    """Prefix-LM per packed document: inside each document the first ``prefix_fraction`` of its tokens see each
    other bidirectionally and the rest is causal; documents never see each other.

    Analytic (`DocBand`): with t the place inside the document and p its prefix, key t_k is visible to query t_q
    iff ``t_k <= max(t_q, p - 1)``: query positions ``max(t_q, p - 1)``, key positions t_k, band ``j - i <= 0``.
    """
    S = _check_int("S", S, 1)
    frac = _check_fraction("prefix_fraction", prefix_fraction, lo_open=False)
    lengths = doc_lengths(S, seed=seed, cap=cap)
    ids, starts = _ids_and_offsets(lengths, device)
    pre = torch.tensor([int(L * frac) for L in lengths], dtype=torch.int64)
    p_tok = pre.repeat_interleave(torch.tensor(lengths)).to(device)
    t = torch.arange(S, device=device) - starts
    q_pos = starts + torch.maximum(t, p_tok - 1)
    k_pos = torch.arange(S, device=device)

    def mod(b, h, q, kv):
        return (ids[q] == ids[kv]) & ((kv <= q) | (kv - starts[kv] < p_tok[kv]))

    def dense():
        def fill_for(p):
            def fill(L):
                m = _tril(L)
                m[:, :p] = True
                return m

            return fill

        m = torch.zeros(S, S, dtype=torch.bool)
        s = 0
        for L, p in zip(lengths, pre.tolist()):
            m[s : s + L, s : s + L] = fill_for(p)(L)
            s += L
        return m

    area = sum(_prefix_rows(L, p) for L, p in zip(lengths, pre.tolist()))
    rule = DocBand(q_doc=ids, k_doc=ids, q_pos=q_pos, k_pos=k_pos, hi=0)
    return MaskCase(
        "prefix_lm_document",
        S,
        {"seed": seed, "cap": _cap(S, cap), "prefix_fraction": frac, "documents": len(lengths)},
        f"{len(lengths)} documents, each a bidirectional prefix then causal",
        MaskMod(mod, rule, "prefix_lm_document"),
        dense,
        lambda: area,
        doc_lengths=lengths,
    )


def global_sliding_window(
    S: int, window: int = 1024, global_tokens: int = 128, device: torch.device | str = "cpu"
) -> MaskCase:
    """Global + sliding window (Longformer / BigBird): ``|i - j| < window``, and the first ``global_tokens`` tokens
    see and are seen by every token."""
    S, w = _check_int("S", S, 1), _check_int("window", window, 1)
    g = _check_int("global_tokens", global_tokens, 0)

    def dense():
        m = torch.ones(S, S, dtype=torch.bool).triu(-(w - 1)).tril(w - 1)
        m[:g, :] = True
        m[:, :g] = True
        return m

    def area():
        i = torch.arange(S, dtype=torch.int64)
        lo, hi = (i - (w - 1)).clamp(0, S - 1), (i + (w - 1)).clamp(0, S - 1)
        band = hi - lo + 1
        overlap = (torch.minimum(hi, torch.tensor(g - 1)) - lo + 1).clamp_min(0)
        row = torch.where(i < g, torch.tensor(S), band + min(g, S) - overlap)
        return int(row.sum())

    return MaskCase(
        "global_sliding_window",
        S,
        {"window": w, "global_tokens": g},
        f"|i - j| < {w}, plus {g} global rows and columns",
        local_global_mask(w, g),
        dense,
        area,
    )


def block_causal_document(
    S: int, seed: int = 0, cap: int | None = None, block: int = 512, device: torch.device | str = "cpu"
) -> MaskCase:
    """Block-causal inside packed documents (chunked / semi-autoregressive generation): each document is cut into
    blocks of ``block`` tokens; a token sees every token of its own block and of the earlier blocks of its document.

    Analytic (`DocBand`): key t_k is visible to query t_q iff ``t_k <= (t_q // block + 1) * block - 1``: query
    positions at the end of their block, band ``j - i <= 0``.
    """
    S = _check_int("S", S, 1)
    block = _check_int("block", block, 1)
    lengths = doc_lengths(S, seed=seed, cap=cap)
    ids, starts = _ids_and_offsets(lengths, device)
    t = torch.arange(S, device=device) - starts
    q_pos = starts + (t // block + 1) * block - 1
    k_pos = torch.arange(S, device=device)

    def mod(b, h, q, kv):
        return (ids[q] == ids[kv]) & ((kv - starts[kv]) // block <= (q - starts[q]) // block)

    def dense():
        def fill(L):
            blk = torch.arange(L) // block
            return blk[None, :] <= blk[:, None]

        return _blocks_dense(lengths, fill)

    def area():
        tot = 0
        for L in lengths:
            tq = torch.arange(L, dtype=torch.int64)
            tot += int(((tq // block + 1) * block).clamp(max=L).sum())
        return tot

    rule = DocBand(q_doc=ids, k_doc=ids, q_pos=q_pos, k_pos=k_pos, hi=0)
    return MaskCase(
        "block_causal_document",
        S,
        {"seed": seed, "cap": _cap(S, cap), "block": block, "documents": len(lengths)},
        f"{len(lengths)} documents, blocks of {block} tokens, block-causal inside each",
        MaskMod(mod, rule, f"block_causal_document({block})"),
        dense,
        area,
        doc_lengths=lengths,
    )


def random_block_sparse(
    S: int, density: float = 0.1, seed: int = 0, block_size: int = 128, device: torch.device | str = "cpu"
) -> MaskCase:
    """Random block-sparse (the FlashAttention paper's block-sparse form): the score matrix cut into
    ``block_size`` x ``block_size`` blocks, each kept (every entry visible) with probability ``density``, the same
    layout for every head (a CPU generator seeded with ``seed``)."""
    S = _check_int("S", S, 1)
    dens = _check_fraction("density", density, lo_open=True)
    bs = _check_int("block_size", block_size, 1)
    n = -(-S // bs)
    lay_cpu = torch.rand(n, n, generator=torch.Generator().manual_seed(seed)) < dens
    lay = lay_cpu.to(device)

    def mod(b, h, q, kv):
        return lay[q // bs, kv // bs]

    def dense():
        return lay_cpu.repeat_interleave(bs, 0).repeat_interleave(bs, 1)[:S, :S].clone()

    def area():
        v = (S - torch.arange(n) * bs).clamp(max=bs)
        return int((lay_cpu.to(torch.int64) * v[:, None] * v[None, :]).sum())

    return MaskCase(
        f"block_sparse_{round(dens * 100)}",
        S,
        {"density": dens, "seed": seed, "block_size": bs},
        f"random {bs} x {bs} blocks kept with probability {dens:g}",
        MaskMod(mod, None, f"block_sparse({dens:g})"),
        dense,
        area,
        layout=lay,
        block_size=bs,
    )


# ----------------------------------------------------------------------------------------------------------
# The catalogue
# ----------------------------------------------------------------------------------------------------------

# name -> (generator, default parameters). Adding a mask: a generator above and one line here.
CATALOGUE: dict[str, tuple[Callable[..., MaskCase], dict]] = {
    "full": (full, {}),
    "causal": (causal, {}),
    "sliding_window": (sliding_window, {}),
    "causal_sliding_window": (causal_sliding_window, {}),
    "document": (document, {}),
    "causal_document": (causal_document, {}),
    "share_question": (share_question, {}),
    "causal_blockwise": (causal_blockwise, {}),
    "prefix_lm_causal": (prefix_lm_causal, {}),
    "prefix_lm_document": (prefix_lm_document, {}),
    "global_sliding_window": (global_sliding_window, {}),
    "block_causal_document": (block_causal_document, {}),
    "block_sparse_10": (random_block_sparse, {"density": 0.1}),
    "block_sparse_30": (random_block_sparse, {"density": 0.3}),
    "block_sparse_50": (random_block_sparse, {"density": 0.5}),
}

# Masks drawn at random documents: benchmarked over several seeds.
SEEDED_MASKS = frozenset(
    {"document", "causal_document", "share_question", "causal_blockwise", "prefix_lm_document", "block_causal_document"}
)


def mask_names() -> list[str]:
    """The catalogue's names, in its order."""
    return list(CATALOGUE)


def make_mask(name: str, S: int, *, device: torch.device | str = "cpu", **params) -> MaskCase:
    """Build catalogue entry ``name`` at length S; ``params`` override its defaults (``window=``, ``seed=``, ...).

    Parameters an entry does not take are ignored, so one set (``window``, ``seed``, ``cap``, ``block``,
    ``global_tokens``) can be passed to every entry.

    Raises:
        ValueError: an unknown name (the message lists the catalogue) or bad parameter values.
        TypeError: parameters of the wrong type.
    """
    if name not in CATALOGUE:
        raise ValueError(f"unknown mask {name!r}; the catalogue has: {', '.join(CATALOGUE)}")
    gen, defaults = CATALOGUE[name]
    accepted = set(inspect.signature(gen).parameters)
    kw = {**defaults, **{k: v for k, v in params.items() if k in accepted and v is not None}}
    return gen(S, device=device, **kw)
