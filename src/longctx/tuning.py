"""Tile configs of the Triton attention kernels, per kernel and padded head dim (BLOCK_D).

Each entry is ``(BLOCK_M, BLOCK_N, num_warps, num_stages)``. The first entry of a list is the default used
without autotuning (``LONGCTX_TRITON_AUTOTUNE=0``, the interpreter); with autotuning the short list is timed
once per (head dim, band kind, length bucket, dtype). Lists are kept small so compile time stays reasonable.

BLOCK_M is always the query tile and BLOCK_N the key tile, in every kernel.
"""

import triton

# Chosen from sweeps on the H100 (benchmarks/NOTES.md, runs 2-3 and session 3); the first entry of each list is the
# one used without autotuning, so it must fit every variant (TMA, hand-pipelined QK^T) in shared memory.

# forward: the query tile stays in registers; K/V tiles are pipelined num_stages deep. A fifth element is
# PIPE_QK (the hand-pipelined QK^T; it acts only with TMA loads), default False. At D=128 two 64-row programs of
# 4 warps per SM (one warpgroup each; the scheduler interleaves one's softmax with the other's matmuls) beat
# one 128-row program for dense bands (541 vs 518 TFLOP/s at 8K); the pipelined 128-row tile wins on long
# causal ones; 64x32 tiles win short causal ones with pointer loads (343 vs 281 at 2K). Autotuning picks.
FWD = {
    16: [(128, 64, 4, 3), (64, 64, 4, 3)],
    32: [(128, 64, 4, 3), (64, 64, 4, 3)],
    64: [(128, 64, 4, 3), (128, 64, 4, 4), (128, 32, 4, 3), (64, 32, 4, 3)],
    128: [(128, 64, 8, 3, True), (64, 64, 4, 3), (64, 32, 4, 3), (128, 128, 8, 3)],
    256: [(128, 64, 8, 2), (64, 64, 4, 2)],
}
# dK/dV (deterministic path): one kv tile (BLOCK_N) stays on chip with its fp32 dK, dV; query tiles stream.
BWD_DKDV = {
    16: [(64, 128, 8, 3), (32, 64, 4, 3)],
    32: [(64, 128, 8, 3), (32, 128, 4, 3)],
    64: [(64, 128, 8, 3), (32, 128, 4, 3)],
    128: [(64, 128, 8, 3), (32, 128, 8, 3), (64, 128, 8, 2)],
    256: [(64, 64, 8, 2), (32, 64, 4, 2)],
}
# dK/dV with dQ accumulated by atomics (the fast path): same shapes, more registers.
BWD_DKDV_ATOMIC = {
    16: [(64, 128, 8, 3), (32, 64, 4, 3)],
    32: [(64, 128, 8, 3), (64, 128, 8, 4)],
    64: [(64, 128, 8, 3), (32, 128, 4, 3), (64, 128, 8, 4)],
    128: [(64, 128, 8, 3), (32, 128, 8, 3)],  # 4 stages do not fit with the TMA-reduce dQ (248 KB)
    256: [(64, 64, 8, 2), (32, 64, 4, 2)],
}
# dQ (deterministic path): one query tile stays on chip with its fp32 dQ accumulator; K/V tiles stream.
BWD_DQ = {
    16: [(128, 64, 8, 3), (64, 32, 4, 3)],
    32: [(128, 64, 8, 3), (128, 32, 4, 3)],
    64: [(128, 128, 8, 3), (128, 64, 8, 3), (128, 32, 4, 3)],
    128: [(128, 128, 8, 2), (128, 64, 8, 2), (128, 32, 8, 3), (64, 64, 4, 3)],
    256: [(64, 64, 8, 2), (64, 32, 4, 2)],
}
# the interpreter runs tiny shapes: small tiles keep the numpy emulation fast and exercise many tiles
INTERPRET = (16, 16, 4, 1)


def block_d(head_dim: int) -> int:
    """Head dim padded to a power of two, at least 16 (tl.dot's minimum inner size)."""
    return max(16, triton.next_power_of_2(head_dim))


def table(kind: str) -> dict:
    return {"fwd": FWD, "dkdv": BWD_DKDV, "dkdv_atomic": BWD_DKDV_ATOMIC, "dq": BWD_DQ}[kind]


def meta(kind: str, entry: tuple, pipe_qk: bool = True) -> dict:
    """The constexprs an entry sets besides its tiles: PIPE_QK for the forward (False where ``pipe_qk`` is off)."""
    if kind != "fwd":
        return {}
    return {"PIPE_QK": bool(pipe_qk and len(entry) > 4 and entry[4])}


def configs(kind: str, bd: int, pipe_qk: bool = True, pre_hook=None) -> list:
    """triton.Config list for one kernel kind ("fwd", "dkdv", "dkdv_atomic", "dq") at padded head dim ``bd``;
    ``pre_hook`` runs before every launch of a config (with the kernel's arguments and the config's values)."""
    out, seen = [], set()
    for e in table(kind)[bd]:
        kw = {"BLOCK_M": e[0], "BLOCK_N": e[1], **meta(kind, e, pipe_qk)}
        key = (tuple(sorted(kw.items())), e[2], e[3])
        if key not in seen:  # with PIPE_QK off two entries may coincide
            seen.add(key)
            out.append(triton.Config(kw, num_warps=e[2], num_stages=e[3], pre_hook=pre_hook))
    return out


# -- block-sparse kernels (`longctx.launchers.sparse`; the figures behind each choice: docs/performance.md) ---------

# Triton block-sparse kernels at D=128, tried before the dense tables' entries: with the prefetched block index and
# the swapped grid, forward 128x64 / 8 warps / 3 stages with TMA K/V and dK/dV 64x128/8/3 were the fastest on every
# mask case of the H100 sweep. Other head dims use the dense tables (their first entries that divide the mask block).
SPARSE_TABLES = {
    "fwd": {128: [(128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3)]},
    "dkdv": {128: [(64, 128, 8, 3), (64, 128, 8, 2), (64, 64, 4, 3)]},
    "dq": {128: [(128, 64, 8, 3), (128, 64, 8, 2), (64, 32, 4, 4)]},
}


def sparse_tile_choices(kind: str, bd: int, mask_bs: int, interpret: bool = False) -> list[tuple[int, int, int, int]]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) candidates of a Triton block-sparse kernel ("fwd", "dkdv", "dq") at
    padded head dim ``bd``, best first: the sparse table, then the dense one, kept where both tiles divide the mask's
    block size (a tile never straddles two mask blocks); a square tile of the largest power of two dividing it where
    none does. The interpreter takes the small `INTERPRET` tiles (clipped to the mask block)."""
    if interpret:
        bm, bn, w, s = INTERPRET
        return [(min(bm, mask_bs), min(bn, mask_bs), w, s)]
    # (tiles only: the dense forward's entries may carry a fifth element, its PIPE_QK choice)
    entries = [c[:4] for c in SPARSE_TABLES[kind].get(bd, []) + table(kind)[bd]]
    ok = list(dict.fromkeys(c for c in entries if mask_bs % c[0] == 0 and mask_bs % c[1] == 0))
    if not ok:
        b = 64 if mask_bs % 64 == 0 else 32 if mask_bs % 32 == 0 else 16
        ok = [(b, b, 4, 2)]
    return ok


# Warp-specialised (Gluon, Hopper) block-sparse kernels, per head dim: forward (BLOCK_N, STAGES, PIPE) and backward
# (BLOCK_M, STAGES, EARLY_DV). The dense warp-specialised kernels' configs: 2 or 3 stages measured within the
# run-to-run spread of each other on the sparse masks, and EARLY_DV slower.
SPARSE_WS_FWD = {64: (128, 3, True), 128: (128, 3, True)}
SPARSE_WS_BWD = {64: (64, 2, False), 128: (64, 2, False)}


def sparse_ws_config(kind: str, head_dim: int) -> tuple[int, int, bool] | None:
    """The warp-specialised block-sparse kernel's config ("fwd" or "bwd") at ``head_dim``, None where it has none."""
    return (SPARSE_WS_FWD if kind == "fwd" else SPARSE_WS_BWD).get(head_dim)


# -- developer overrides: the one place they are read ------------------------------------------------------------
# For kernel developers and tests, never needed to use longctx: force a kernel path or a tile to compare variants.
# Set for a whole process with LONGCTX_TUNING="key=value,key=value" (read once, here) or in code with
# `with tuning.override(key=value): ...`. Keys and their meaning: docs/tuning.md. Unknown keys raise.
import contextlib as _contextlib
import os as _os

# key -> default (None: follow the measured rules of this module)
_OVERRIDE_DEFAULTS: dict = {}
# block-sparse kernels (`longctx.launchers.sparse`): False switches the warp-specialised forward / backward off (the
# Triton kernels run, as on other GPUs); tiles of the Triton kernels forced per kind, no autotuning ("fwd:128x64x8x3;
# dkdv:64x128x8x3", or a dict kind -> tuple in code); tensor-descriptor loads under the interpreter (tests; None: as
# `launchers.runtime` decides)
_OVERRIDE_DEFAULTS.update(sparse_ws=None, sparse_ws_bwd=None, sparse_tiles=None, sparse_tma_in_interpreter=None)
_OVERRIDES: dict = {}
_ENV_READ: list[bool] = []


def _parse_env(text: str) -> dict:
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, val = part.partition("=")
        key = key.strip()
        if not sep or key not in _OVERRIDE_DEFAULTS:
            raise ValueError(
                f"LONGCTX_TUNING entry {part!r}: expected key=value with key one of {sorted(_OVERRIDE_DEFAULTS)}"
            )
        low = val.strip().lower()
        out[key] = True if low in ("1", "true", "on", "yes") else False if low in ("0", "false", "off", "no") else val
    return out


def get(key: str):
    """The developer override of ``key``, or its default (None: the measured rule applies)."""
    if key not in _OVERRIDE_DEFAULTS:
        raise KeyError(f"unknown tuning key {key!r}; known: {sorted(_OVERRIDE_DEFAULTS)}")
    _read_env()
    return _OVERRIDES.get(key, _OVERRIDE_DEFAULTS[key])


def _read_env() -> None:
    if not _ENV_READ:
        _ENV_READ.append(True)
        _OVERRIDES.update(_parse_env(_os.environ.get("LONGCTX_TUNING", "")))


@_contextlib.contextmanager
def override(**values):
    """Force tuning keys for the duration of a ``with`` block (tests, benchmarks of variants)."""
    unknown = sorted(set(values) - set(_OVERRIDE_DEFAULTS))
    if unknown:
        raise KeyError(f"unknown tuning keys {unknown}; known: {sorted(_OVERRIDE_DEFAULTS)}")
    _read_env()
    saved = dict(_OVERRIDES)
    _OVERRIDES.update(values)
    try:
        yield
    finally:
        _OVERRIDES.clear()
        _OVERRIDES.update(saved)
