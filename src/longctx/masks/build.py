"""Builders of `BlockMask`: `block_mask(mask_mod, B, H, Sq, Sk)` (analytic rules in O(blocks), any other mask_mod
evaluated in row chunks)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from longctx.masks.band import Band
from longctx.masks.block_mask import EMPTY, FULL, PARTIAL, BlockMask
from longctx.masks.mask_mods import DocBand, MaskMod, _check_pos_int, _rule_tiles

# ----------------------------------------------------------------------------------------------------------
# Builders
# ----------------------------------------------------------------------------------------------------------


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
                m = _call_mask_mod(mask_mod, tb, th, qi.clamp(max=max(sq - 1, 0)), kj_eval)
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


def _call_mask_mod(
    mask_mod: Callable, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
) -> torch.Tensor:
    """``mask_mod(b, h, q_idx, kv_idx)`` for q_idx (n, 1) and kv_idx (1, m), checked: a bool tensor of shape
    (n, m), (n, 1), (1, m), (1, 1) or () (a rule that ignores an index broadcasts along it)."""
    name = getattr(mask_mod, "__name__", type(mask_mod).__name__)
    try:
        m = mask_mod(b, h, q_idx, kv_idx)
    except RuntimeError as e:
        if "Boolean value of Tensor" not in str(e):
            raise
        raise TypeError(
            f"mask_mod {name!r} uses Python control flow (if/and/or/not) on its arguments: {e}. It is called with "
            f"index tensors (q_idx of shape {tuple(q_idx.shape)}, kv_idx of shape {tuple(kv_idx.shape)}), so write "
            "the rule with tensor operations: & | ~ instead of and/or/not, torch.where(cond, a, b) instead of if"
        ) from None
    if not isinstance(m, torch.Tensor) or m.dtype != torch.bool:
        got = m.dtype if isinstance(m, torch.Tensor) else f"{type(m).__name__} {m!r}"
        raise TypeError(
            f"mask_mod {name!r} must return a bool tensor (True where the query sees the key), got {got}; compare "
            "the indices (e.g. q_idx >= kv_idx) instead of returning numbers"
        )
    n, k = q_idx.shape[0], kv_idx.shape[1]
    if not (m.dim() == 0 or (m.dim() == 2 and m.shape[0] in (1, n) and m.shape[1] in (1, k))):
        raise ValueError(
            f"mask_mod {name!r} returned shape {tuple(m.shape)} for q_idx {tuple(q_idx.shape)} and kv_idx "
            f"{tuple(kv_idx.shape)}; expected the broadcast shape ({n}, {k}) (or (n, 1), (1, m), (1, 1), () for a "
            "rule that ignores an index): compute it elementwise from q_idx and kv_idx, without reducing or "
            "indexing them"
        )
    return m


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
        TypeError: a non-callable mask_mod, one returning a non-bool result, or one using Python control flow
            on its tensor arguments (with a hint to use ``&``, ``|``, ``torch.where``).
        ValueError: bad sizes, a mask_mod result of a shape other than the broadcast of q_idx and kv_idx, or a
            CUDA device on a machine without CUDA.
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
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"block_mask(..., device={str(device)!r}): CUDA is not available on this machine; pass device='cpu' "
            "(or leave device=None), and keep q, k, v on the same device"
        )
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


def band_block_mask(band: Band, Sq: int, Sk: int, block_size: int, device: torch.device) -> BlockMask:
    """The `BlockMask` (batch 1, heads 1) of a `Band` over Sq queries and Sk keys: what the dense launchers hand to
    the block-sparse kernels where those are the faster ones (`longctx.tuning.band_via_sparse`)."""
    band = band.within(Sq, Sk)
    return _build_analytic(DocBand(lo=band.lo, hi=band.hi), Sq, Sk, block_size, device, None, "band")
