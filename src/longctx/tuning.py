"""The measured defaults of longctx's kernels, and the one place developer overrides are read.

Every choice the launchers make that was settled by measurement lives here as a plain table or a small pure function,
each with a one-line reason; the figures behind them are in docs/performance.md (and benchmarks/results/). The
launchers (`longctx.launchers`) call these; nothing here imports Triton or torch, so the rules can be read and
tested anywhere. The last section holds the developer overrides (`get`, `override`, ``LONGCTX_TUNING``): see
docs/tuning.md.

Tile entries are ``(BLOCK_M, BLOCK_N, num_warps, num_stages)``; BLOCK_M is always the query tile and BLOCK_N the key
tile, in every kernel. Which entry runs is measured ahead of time per GPU (`MEASURED_TILES`, written by
dev/tune_tiles.py); the first entry of a list is the one used where no measurement exists (another GPU, the
interpreter), so it must fit every variant of its kernel in shared memory. Run-time autotuning over a list (the
``autotune`` override on) is for kernel development only: it compiles and times every entry at the first call of
each (head dim, band kind, length bucket), which stalls training for seconds.
"""

from __future__ import annotations

import contextlib as _contextlib
import functools as _functools
import os as _os

# -- dense Triton kernels (`longctx.launchers.flash`) -------------------------------------------------------------

# Forward: the query tile stays in registers, K/V tiles are pipelined num_stages deep. A fifth element True turns on
# PIPE_QK (the next tile's QK^T issued before this tile's softmax; it acts only with TMA loads).
# D=128: the pipelined 128-row tile wins long causal bands; two 64-row programs of one warpgroup each per SM win
# dense bands (the scheduler interleaves one's softmax with the other's matmuls); 64x32 wins short causal ones.
# PIPE_QK lost at D=64 (registers), so no D=64 entry has it. Autotuning picks among them.
FWD = {
    16: [(128, 64, 4, 3), (64, 64, 4, 3)],
    32: [(128, 64, 4, 3), (64, 64, 4, 3)],
    64: [(128, 64, 4, 3), (128, 64, 4, 4), (128, 32, 4, 3), (64, 32, 4, 3)],
    128: [(128, 64, 8, 3, True), (64, 64, 4, 3), (64, 32, 4, 3), (128, 128, 8, 3)],
    256: [(128, 64, 8, 2), (64, 64, 4, 2)],
}
# dK/dV without dQ (the deterministic path): one kv tile (BLOCK_N) stays on chip with its fp32 dK, dV; query tiles
# stream. 32-row query tiles win for GQA (more programs per kv head).
BWD_DKDV = {
    16: [(64, 128, 8, 3), (32, 64, 4, 3)],
    32: [(64, 128, 8, 3), (32, 128, 4, 3)],
    64: [(64, 128, 8, 3), (32, 128, 4, 3)],
    128: [(64, 128, 8, 3), (32, 128, 8, 3), (64, 128, 8, 2)],
    256: [(64, 64, 8, 2), (32, 64, 4, 2)],
}
# dK/dV with dQ added by atomics (the fast path): the same shapes, more registers.
BWD_DKDV_ATOMIC = {
    16: [(64, 128, 8, 3), (32, 64, 4, 3)],
    32: [(64, 128, 8, 3), (64, 128, 8, 4)],
    64: [(64, 128, 8, 3), (32, 128, 4, 3), (64, 128, 8, 4)],
    128: [(64, 128, 8, 3), (32, 128, 8, 3)],  # 4 stages do not fit with the TMA-reduce dQ (248 KB)
    256: [(64, 64, 8, 2), (32, 64, 4, 2)],
}
# dK alone and dV alone (`split_dkdv`, D=256): each program holds one fp32 product of a 128-row kv tile, and the query
# tiles stream. Only head dims that split have lists.
BWD_DK = {256: [(32, 128, 8, 1), (64, 128, 8, 1), (32, 128, 8, 2), (16, 128, 8, 2), (64, 64, 8, 2)]}
BWD_DV = {256: [(64, 128, 8, 1), (32, 128, 8, 2), (64, 128, 8, 2), (128, 128, 8, 1), (64, 64, 8, 2)]}
# dQ (the deterministic path): one query tile stays on chip with its fp32 dQ; K/V tiles stream. 128x128 wins GQA.
BWD_DQ = {
    16: [(128, 64, 8, 3), (64, 32, 4, 3)],
    32: [(128, 64, 8, 3), (128, 32, 4, 3)],
    64: [(128, 128, 8, 3), (128, 64, 8, 3), (128, 32, 4, 3)],
    128: [(128, 128, 8, 2), (128, 64, 8, 2), (128, 32, 8, 3), (64, 64, 4, 3)],
    256: [(64, 64, 8, 2), (64, 32, 4, 2), (128, 32, 8, 2), (128, 64, 8, 1)],
}
# the interpreter runs tiny shapes: small tiles keep the numpy emulation fast and exercise many tiles
INTERPRET = (16, 16, 4, 1)

KINDS = ("fwd", "dkdv", "dkdv_atomic", "dk", "dv", "dq")


def block_d(head_dim: int) -> int:
    """Head dim padded to a power of two, at least 16 (tl.dot's minimum inner size)."""
    return max(16, 1 << max(0, head_dim - 1).bit_length())


def table(kind: str) -> dict[int, list[tuple]]:
    """The tile lists of one kernel kind (one of `KINDS`), per padded head dim."""
    lists = {"fwd": FWD, "dkdv": BWD_DKDV, "dkdv_atomic": BWD_DKDV_ATOMIC, "dk": BWD_DK, "dv": BWD_DV, "dq": BWD_DQ}
    return lists[kind]


def meta(kind: str, entry: tuple) -> dict[str, bool]:
    """The constexprs an entry sets besides its tiles: the forward's PIPE_QK."""
    if kind != "fwd":
        return {}
    return {"PIPE_QK": bool(len(entry) > 4 and entry[4])}


def entries(kind: str, bd: int) -> list[tuple[dict, int, int]]:
    """The candidates of one kernel at padded head dim ``bd`` (for `dev/tune_tiles.py` and the ``autotune``
    override): ``(constexprs, num_warps, num_stages)``."""
    return [({"BLOCK_M": e[0], "BLOCK_N": e[1], **meta(kind, e)}, e[2], e[3]) for e in table(kind)[bd]]


def seq_bucket(n: int) -> int:
    """Length bucket of the tile-table key (and of the ``autotune`` override's key): one per power of two from <=1K
    to <=16K, then longer (the best tile differs between 2K and 4K, 8K and 16K)."""
    return 0 if n <= 1024 else min(5, (n - 1).bit_length() - 10)


def fwd_kv_loads(min_len: int, tma_loadable: bool, broadcast: bool) -> tuple[bool, bool]:
    """(USE_TMA, TMA_HOST) of the Triton forward's K/V tiles.

    TMA descriptors wherever the tensors allow them (fewer address registers, loads off the warps); pointer loads
    for unaligned views and lengths under 16 (ptxas crashed on the TMA variant specialised for a length of 1 at
    D=256, and TMA gains nothing there). The descriptors are built once on the host (no global write and fence per
    program), except for broadcast (stride 0) views: a host descriptor spans (B, Hkv, Sk, D) with the tensor's own
    strides, so those build one per program, over the head's rows only.
    """
    use_tma = min_len >= 16 and tma_loadable
    return use_tma, use_tma and not broadcast


def atomic_dq(bd: int, sq: int, dense_band: bool, grouped: bool) -> bool:
    """Whether the backward adds dQ inside the dK/dV kernel (5 matmuls per tile pair, atomics) rather than in a
    separate dQ kernel (7 matmuls, each element written once); the caller keeps the separate kernel under
    ``deterministic``.

    - D > 128: never (the atomic variant needs more shared memory than a block has).
    - D = 128 (dQ by one TMA reduce per tile): from Sq > 2K, except GQA, where the separate kernels' 128x128 dQ tile
      wins.
    - D <= 64 (scalar atomics): from Sq > 2K for causal-like bands, from Sq > 4K for dense ones.
    """
    if bd > 128 or (bd == 128 and grouped):
        return False
    return sq > (4096 if bd <= 64 and dense_band else 2048)


def split_dkdv(bd: int) -> bool:
    """Whether the backward computes dV and dK in two launches of the dK/dV kernel (2 + 3 matmuls per tile pair)
    instead of one (4): at D=256 the two fp32 accumulators of a 64-row kv tile take 128 of a thread's 255
    registers, and the chained score matmuls then run on both warpgroups redundantly and spill (docs/performance.md,
    "The head-dim-256 backward"); alone, each product fits a 128-row kv tile. dQ then always comes from the dQ kernel:
    added by atomics from the dK launch it measured slower."""
    return bd > 128


def dq_by_tma_reduce(head_dim: int) -> bool:
    """The atomic-dQ backward adds each dQ tile by one TMA bulk reduction at D=128, where it beat scalar float32
    atomics; at smaller head dims the scalar atomics win."""
    return head_dim == 128


# -- which entry of the tile lists runs: measured ahead of time, per GPU ------------------------------------------
# Timing the candidates at run time compiled each one and stalled the first call of every (head dim, band, length
# bucket) for seconds. `dev/tune_tiles.py` times them once per GPU instead and writes the winners below. Key
# "kind:bd:band:bucket:group" (band: full, causal or window; group: mha or gqa; block-sparse kinds: "sparse_fwd",
# "sparse_dkdv", "sparse_dq" with the mask block size in place of band and group); value: the index of the winning
# entry in `table(kind)[bd]` (`sparse_tile_choices` for block-sparse). A GPU without a row takes the row of the nearest
# measured GPU of its compute capability (`tile_row`); a key the row lacks runs the entry of the nearest measured
# length bucket of that key, else the list's first entry.
MEASURED_TILES: dict[str, dict[str, int]] = {
    # BEGIN MEASURED TILES (written by dev/tune_tiles.py)
    "NVIDIA H100 80GB HBM3": {
        "dk:256:causal:1:mha": 2,
        "dk:256:causal:4:mha": 2,
        "dk:256:full:1:mha": 1,
        "dk:256:full:4:mha": 1,
        "dkdv:128:causal:0:gqa": 1,
        "dkdv:128:causal:0:mha": 0,
        "dkdv:128:causal:1:gqa": 1,
        "dkdv:128:causal:1:mha": 0,
        "dkdv:128:causal:2:gqa": 2,
        "dkdv:128:causal:2:mha": 0,
        "dkdv:128:causal:4:gqa": 2,
        "dkdv:128:causal:4:mha": 0,
        "dkdv:128:full:0:gqa": 1,
        "dkdv:128:full:0:mha": 0,
        "dkdv:128:full:1:gqa": 1,
        "dkdv:128:full:1:mha": 0,
        "dkdv:128:full:2:gqa": 1,
        "dkdv:128:full:2:mha": 0,
        "dkdv:128:full:4:gqa": 0,
        "dkdv:128:full:4:mha": 0,
        "dkdv:64:causal:0:mha": 1,
        "dkdv:64:causal:1:mha": 1,
        "dkdv:64:causal:2:mha": 1,
        "dkdv:64:causal:4:mha": 1,
        "dkdv:64:full:0:mha": 1,
        "dkdv:64:full:1:mha": 1,
        "dkdv:64:full:2:mha": 1,
        "dkdv:64:full:4:mha": 1,
        "dkdv_atomic:128:causal:0:gqa": 1,
        "dkdv_atomic:128:causal:0:mha": 0,
        "dkdv_atomic:128:causal:1:gqa": 1,
        "dkdv_atomic:128:causal:1:mha": 1,
        "dkdv_atomic:128:causal:2:gqa": 0,
        "dkdv_atomic:128:causal:2:mha": 0,
        "dkdv_atomic:128:causal:4:gqa": 0,
        "dkdv_atomic:128:causal:4:mha": 0,
        "dkdv_atomic:128:full:0:gqa": 1,
        "dkdv_atomic:128:full:0:mha": 0,
        "dkdv_atomic:128:full:1:gqa": 0,
        "dkdv_atomic:128:full:1:mha": 1,
        "dkdv_atomic:128:full:2:gqa": 0,
        "dkdv_atomic:128:full:2:mha": 0,
        "dkdv_atomic:128:full:4:gqa": 0,
        "dkdv_atomic:128:full:4:mha": 0,
        "dkdv_atomic:64:causal:0:mha": 1,
        "dkdv_atomic:64:causal:1:mha": 1,
        "dkdv_atomic:64:causal:2:mha": 1,
        "dkdv_atomic:64:causal:4:mha": 2,
        "dkdv_atomic:64:full:0:mha": 1,
        "dkdv_atomic:64:full:1:mha": 2,
        "dkdv_atomic:64:full:2:mha": 1,
        "dkdv_atomic:64:full:4:mha": 2,
        "dq:128:causal:0:gqa": 0,
        "dq:128:causal:0:mha": 2,
        "dq:128:causal:1:gqa": 0,
        "dq:128:causal:1:mha": 2,
        "dq:128:causal:2:gqa": 0,
        "dq:128:causal:2:mha": 0,
        "dq:128:causal:4:gqa": 0,
        "dq:128:causal:4:mha": 0,
        "dq:128:full:0:gqa": 0,
        "dq:128:full:0:mha": 0,
        "dq:128:full:1:gqa": 0,
        "dq:128:full:1:mha": 0,
        "dq:128:full:2:gqa": 0,
        "dq:128:full:2:mha": 0,
        "dq:128:full:4:gqa": 0,
        "dq:128:full:4:mha": 0,
        "dq:256:causal:1:mha": 3,
        "dq:256:causal:4:mha": 3,
        "dq:256:full:1:mha": 3,
        "dq:256:full:4:mha": 3,
        "dq:64:causal:0:mha": 2,
        "dq:64:causal:1:mha": 0,
        "dq:64:causal:2:mha": 0,
        "dq:64:causal:4:mha": 0,
        "dq:64:full:0:mha": 2,
        "dq:64:full:1:mha": 1,
        "dq:64:full:2:mha": 0,
        "dq:64:full:4:mha": 0,
        "dv:256:causal:1:mha": 2,
        "dv:256:causal:4:mha": 2,
        "dv:256:full:1:mha": 2,
        "dv:256:full:4:mha": 2,
        "fwd:128:causal:0:gqa": 2,
        "fwd:128:causal:0:mha": 3,
        "fwd:128:causal:1:gqa": 3,
        "fwd:128:causal:1:mha": 2,
        "fwd:128:causal:2:gqa": 0,
        "fwd:128:causal:2:mha": 1,
        "fwd:128:causal:4:gqa": 0,
        "fwd:128:causal:4:mha": 0,
        "fwd:128:full:0:gqa": 1,
        "fwd:128:full:0:mha": 0,
        "fwd:128:full:1:gqa": 2,
        "fwd:128:full:1:mha": 0,
        "fwd:128:full:2:gqa": 1,
        "fwd:128:full:2:mha": 1,
        "fwd:128:full:4:gqa": 0,
        "fwd:128:full:4:mha": 3,
        "fwd:256:causal:0:mha": 0,
        "fwd:256:causal:1:mha": 0,
        "fwd:256:causal:2:mha": 0,
        "fwd:256:causal:4:mha": 0,
        "fwd:256:full:0:mha": 0,
        "fwd:256:full:1:mha": 0,
        "fwd:256:full:2:mha": 0,
        "fwd:256:full:4:mha": 0,
        "fwd:64:causal:0:mha": 0,
        "fwd:64:causal:1:mha": 2,
        "fwd:64:causal:2:mha": 0,
        "fwd:64:causal:4:mha": 0,
        "fwd:64:full:0:mha": 0,
        "fwd:64:full:1:mha": 0,
        "fwd:64:full:2:mha": 0,
        "fwd:64:full:4:mha": 1,
        "sparse_dkdv:64:128:2": 1,
        "sparse_fwd:64:128:2": 2,
    },
    "NVIDIA H200": {
        "dk:256:causal:0:mha": 2,
        "dk:256:causal:1:mha": 2,
        "dk:256:causal:2:mha": 2,
        "dk:256:causal:4:mha": 2,
        "dk:256:full:0:mha": 1,
        "dk:256:full:1:mha": 1,
        "dk:256:full:2:mha": 1,
        "dk:256:full:4:mha": 1,
        "dkdv:128:causal:0:gqa": 1,
        "dkdv:128:causal:0:mha": 0,
        "dkdv:128:causal:1:gqa": 1,
        "dkdv:128:causal:1:mha": 0,
        "dkdv:128:causal:2:gqa": 2,
        "dkdv:128:causal:2:mha": 0,
        "dkdv:128:causal:4:gqa": 2,
        "dkdv:128:causal:4:mha": 0,
        "dkdv:128:full:0:gqa": 1,
        "dkdv:128:full:0:mha": 0,
        "dkdv:128:full:1:gqa": 1,
        "dkdv:128:full:1:mha": 0,
        "dkdv:128:full:2:gqa": 1,
        "dkdv:128:full:2:mha": 0,
        "dkdv:128:full:4:gqa": 0,
        "dkdv:128:full:4:mha": 0,
        "dkdv:64:causal:0:mha": 1,
        "dkdv:64:causal:1:mha": 1,
        "dkdv:64:causal:2:mha": 1,
        "dkdv:64:causal:4:mha": 1,
        "dkdv:64:full:0:mha": 1,
        "dkdv:64:full:1:mha": 1,
        "dkdv:64:full:2:mha": 1,
        "dkdv:64:full:4:mha": 1,
        "dkdv_atomic:128:causal:0:gqa": 1,
        "dkdv_atomic:128:causal:0:mha": 0,
        "dkdv_atomic:128:causal:1:gqa": 0,
        "dkdv_atomic:128:causal:1:mha": 0,
        "dkdv_atomic:128:causal:2:gqa": 0,
        "dkdv_atomic:128:causal:2:mha": 0,
        "dkdv_atomic:128:causal:4:gqa": 0,
        "dkdv_atomic:128:causal:4:mha": 0,
        "dkdv_atomic:128:full:0:gqa": 1,
        "dkdv_atomic:128:full:0:mha": 0,
        "dkdv_atomic:128:full:1:gqa": 0,
        "dkdv_atomic:128:full:1:mha": 0,
        "dkdv_atomic:128:full:2:gqa": 0,
        "dkdv_atomic:128:full:2:mha": 0,
        "dkdv_atomic:128:full:4:gqa": 0,
        "dkdv_atomic:128:full:4:mha": 0,
        "dkdv_atomic:64:causal:0:mha": 1,
        "dkdv_atomic:64:causal:1:mha": 1,
        "dkdv_atomic:64:causal:2:mha": 0,
        "dkdv_atomic:64:causal:4:mha": 0,
        "dkdv_atomic:64:full:0:mha": 1,
        "dkdv_atomic:64:full:1:mha": 0,
        "dkdv_atomic:64:full:2:mha": 0,
        "dkdv_atomic:64:full:4:mha": 0,
        "dq:128:causal:0:gqa": 0,
        "dq:128:causal:0:mha": 1,
        "dq:128:causal:1:gqa": 0,
        "dq:128:causal:1:mha": 2,
        "dq:128:causal:2:gqa": 0,
        "dq:128:causal:2:mha": 0,
        "dq:128:causal:4:gqa": 0,
        "dq:128:causal:4:mha": 0,
        "dq:128:full:0:gqa": 0,
        "dq:128:full:0:mha": 0,
        "dq:128:full:1:gqa": 0,
        "dq:128:full:1:mha": 0,
        "dq:128:full:2:gqa": 0,
        "dq:128:full:2:mha": 0,
        "dq:128:full:4:gqa": 0,
        "dq:128:full:4:mha": 0,
        "dq:256:causal:0:mha": 3,
        "dq:256:causal:1:mha": 3,
        "dq:256:causal:2:mha": 3,
        "dq:256:causal:4:mha": 3,
        "dq:256:full:0:mha": 3,
        "dq:256:full:1:mha": 3,
        "dq:256:full:2:mha": 3,
        "dq:256:full:4:mha": 3,
        "dq:64:causal:0:mha": 0,
        "dq:64:causal:1:mha": 0,
        "dq:64:causal:2:mha": 0,
        "dq:64:causal:4:mha": 0,
        "dq:64:full:0:mha": 0,
        "dq:64:full:1:mha": 0,
        "dq:64:full:2:mha": 0,
        "dq:64:full:4:mha": 0,
        "dv:256:causal:0:mha": 2,
        "dv:256:causal:1:mha": 2,
        "dv:256:causal:2:mha": 2,
        "dv:256:causal:4:mha": 2,
        "dv:256:full:0:mha": 2,
        "dv:256:full:1:mha": 2,
        "dv:256:full:2:mha": 2,
        "dv:256:full:4:mha": 2,
        "fwd:128:causal:0:gqa": 3,
        "fwd:128:causal:0:mha": 3,
        "fwd:128:causal:1:gqa": 1,
        "fwd:128:causal:1:mha": 0,
        "fwd:128:causal:2:gqa": 1,
        "fwd:128:causal:2:mha": 0,
        "fwd:128:causal:4:gqa": 1,
        "fwd:128:causal:4:mha": 0,
        "fwd:128:full:0:gqa": 0,
        "fwd:128:full:0:mha": 2,
        "fwd:128:full:1:gqa": 1,
        "fwd:128:full:1:mha": 1,
        "fwd:128:full:2:gqa": 1,
        "fwd:128:full:2:mha": 1,
        "fwd:128:full:4:gqa": 0,
        "fwd:128:full:4:mha": 0,
        "fwd:256:causal:0:mha": 0,
        "fwd:256:causal:1:mha": 0,
        "fwd:256:causal:2:mha": 0,
        "fwd:256:causal:4:mha": 0,
        "fwd:256:full:0:mha": 0,
        "fwd:256:full:1:mha": 0,
        "fwd:256:full:2:mha": 0,
        "fwd:256:full:4:mha": 0,
        "fwd:64:causal:0:mha": 0,
        "fwd:64:causal:1:mha": 0,
        "fwd:64:causal:2:mha": 0,
        "fwd:64:causal:4:mha": 0,
        "fwd:64:full:0:mha": 3,
        "fwd:64:full:1:mha": 0,
        "fwd:64:full:2:mha": 0,
        "fwd:64:full:4:mha": 0,
        "sparse_dkdv:128:128:2": 1,
        "sparse_dkdv:128:128:4": 1,
        "sparse_dkdv:128:128:5": 1,
        "sparse_dkdv:64:128:2": 1,
        "sparse_dkdv:64:128:4": 1,
        "sparse_dkdv:64:128:5": 1,
        "sparse_dq:128:128:2": 1,
        "sparse_dq:128:128:4": 0,
        "sparse_dq:128:128:5": 0,
        "sparse_dq:64:128:2": 0,
        "sparse_dq:64:128:4": 2,
        "sparse_dq:64:128:5": 2,
        "sparse_fwd:128:128:2": 3,
        "sparse_fwd:128:128:4": 4,
        "sparse_fwd:128:128:5": 2,
        "sparse_fwd:64:128:2": 0,
        "sparse_fwd:64:128:4": 0,
        "sparse_fwd:64:128:5": 0,
    },
    # END MEASURED TILES
}


def band_kind(has_lo: bool, has_hi: bool) -> str:
    """The band's kind in tile-table keys: "full" (no bound), "causal" (an upper bound only) or "window" (else)."""
    return "full" if not (has_lo or has_hi) else "causal" if has_hi and not has_lo else "window"


def tile_key(kind: str, bd: int, band: str, bucket: int, grouped: bool) -> str:
    """The `MEASURED_TILES` key of a dense Triton kernel launch."""
    return f"{kind}:{bd}:{band}:{bucket}:{'gqa' if grouped else 'mha'}"


def sparse_tile_key(kind: str, bd: int, mask_bs: int, bucket: int) -> str:
    """The `MEASURED_TILES` key of a block-sparse Triton kernel launch."""
    return f"sparse_{kind}:{bd}:{mask_bs}:{bucket}"


# What is known of each measured GPU, for a GPU without a row of its own: (compute capability, SMs, memory GiB).
MEASURED_GPUS: dict[str, tuple[tuple[int, int], int, int]] = {
    # BEGIN MEASURED GPUS (written by dev/tune_tiles.py)
    "NVIDIA H100 80GB HBM3": ((9, 0), 132, 80),
    "NVIDIA H200": ((9, 0), 132, 140),
    # END MEASURED GPUS
}


def tile_row(name: str, capability: tuple[int, int], sms: int, memory_gib: float) -> tuple[str | None, str]:
    """The `MEASURED_TILES` row that serves a GPU, and why: its own row; else the measured GPU of the same compute
    capability nearest in SM count, then in memory (the tiles depend on the SMs' shared memory and registers, which
    the capability fixes, and on how many SMs share the work); else None, each list's first entry.

    Returns:
        (row name or None, a line saying which and why, as `longctx info` prints it).
    """
    if name in MEASURED_TILES:
        return name, f"{name} (measured on this GPU)"
    same = [(g, facts) for g, facts in MEASURED_GPUS.items() if facts[0] == tuple(capability) and g in MEASURED_TILES]
    if not same:
        cc = f"{capability[0]}.{capability[1]}"
        return None, f"none measured for compute capability {cc}: each tile list's first entry (dev/tune_tiles.py)"

    def distance(facts):
        _, g_sms, g_mem = facts
        return (abs(g_sms - sms) / max(g_sms, 1), abs(g_mem - memory_gib) / max(g_mem, 1))

    row, facts = min(same, key=lambda gf: distance(gf[1]))
    return row, (
        f"{row} (nearest measured GPU of compute capability {capability[0]}.{capability[1]}: {facts[1]} SMs and "
        f"{facts[2]} GiB against this GPU's {sms} and {memory_gib:.0f}; dev/tune_tiles.py measures a row of its own)"
    )


@_functools.lru_cache(maxsize=4096)  # every kernel launch asks; the table is a constant
def measured_index(gpu: str, key: str, n: int) -> int:
    """Index of the measured entry for ``key`` on ``gpu`` among ``n`` candidates: the key's own row, else the row of
    the same key at the nearest length bucket (field 3 of every key), else 0 (the list's first entry)."""
    rows = MEASURED_TILES.get(gpu, {})
    fields = key.split(":")
    near = []
    for k, v in rows.items():
        other = k.split(":")
        if len(other) == len(fields) and other[:3] + other[4:] == fields[:3] + fields[4:]:
            near.append((abs(int(other[3]) - int(fields[3])), v))
    best = min(near)[1] if near else 0
    return best if best < n else 0


# Warp-specialised forward (Gluon, Hopper): head dim -> (BLOCK_N, STAGES, PIPE): key tile, shared-memory ring depth,
# intra-warpgroup overlap. 3 stages win for dense bands and long causal ones; 2 stages for causal-like bands up to 4K.
# D=256: 64-row key tiles in 2 stages (Q of both warpgroups and the ring take 192 KB of shared memory; 128-row tiles
# or a third stage do not fit), the fastest of four configs at every length and band measured.
WS_CONFIG: dict[int, tuple[int, int, bool]] = {64: (128, 3, True), 128: (128, 3, True), 256: (64, 2, True)}
WS_CONFIG_SHORT_CAUSAL: dict[int, tuple[int, int, bool]] = {128: (128, 2, True)}


def ws_fwd_config(head_dim: int, sq: int, sk: int, banded: bool) -> tuple[int, int, bool] | None:
    """The warp-specialised forward's config, or None where the Triton forward measured faster: D=64 with a band,
    and D=128 causal-like bands up to 2K (their masked diagonal tiles are a large share of the work). At D=256 it
    was the faster forward everywhere measured (1K-16K; full, causal, sliding window, softcap)."""
    if head_dim == 64 and banded:
        return None
    if head_dim == 128 and banded:
        n = max(sq, sk)
        if n <= 2048:
            return None
        if n <= 4096:
            return WS_CONFIG_SHORT_CAUSAL[head_dim]
    return WS_CONFIG.get(head_dim)


# Warp-specialised backward (Gluon, Hopper): head dim -> (BLOCK_M, STAGES, EARLY_DV): query tile, ring depth, dV's
# product issued before dS^T (EARLY_DV: the same speed, and dS from the rounded P, so off; 3 stages gained nothing).
# D=256 runs its own dK/dV kernel (`flash_bwd_ws_d256`: 64-row tiles, no EARLY_DV), which takes STAGES only.
WS_BWD_CONFIG: dict[int, tuple[int, int, bool]] = {64: (64, 2, False), 128: (64, 2, False), 256: (64, 2, False)}


def ws_bwd_config(head_dim: int) -> tuple[int, int, bool] | None:
    """The warp-specialised backward's config: it was faster than the Triton backward at every case measured (D 64
    and 128, 2K-16K, dense, causal, GQA; D=256, 1K-16K, dense and causal: 1.33-1.39x), so no rule beyond the head
    dims it has."""
    return WS_BWD_CONFIG.get(head_dim)


# -- block-sparse kernels (`longctx.launchers.sparse`; the figures behind each choice: docs/performance.md) ---------

# Triton block-sparse kernels at D=128, tried before the dense tables' entries: with the prefetched block index and
# the swapped grid, forward 128x64 / 8 warps / 3 stages with TMA K/V and dK/dV 64x128/8/3 were the fastest on every
# mask case of the H100 sweep. D=256 dQ: 128x32 / 8 / 2 beat the dense table's first entry on four document masks
# (4K-16K, the whole backward 1.15-1.20x). Other head dims and kernels use the dense tables (their first entries that
# divide the mask block).
SPARSE_TABLES = {
    "fwd": {128: [(128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3)]},
    "dkdv": {128: [(64, 128, 8, 3), (64, 128, 8, 2), (64, 64, 4, 3)]},
    "dq": {128: [(128, 64, 8, 3), (128, 64, 8, 2), (64, 32, 4, 4)], 256: [(128, 32, 8, 2), (128, 64, 8, 1)]},
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
# run-to-run spread of each other on the sparse masks, and EARLY_DV slower. D=256: the dense forward's config (it
# beat the Triton forward on 10 of 12 document masks, 4K-16K); the backward runs `flash_bwd_ws_d256`'s block-sparse
# dK/dV kernel (STAGES only, as the dense one) and the Triton dQ kernel.
SPARSE_WS_FWD = {64: (128, 3, True), 128: (128, 3, True), 256: (64, 2, True)}
SPARSE_WS_BWD = {64: (64, 2, False), 128: (64, 2, False), 256: (64, 2, False)}


def sparse_ws_config(kind: str, head_dim: int) -> tuple[int, int, bool] | None:
    """The warp-specialised block-sparse kernel's config ("fwd" or "bwd") at ``head_dim``, None where it has none."""
    return (SPARSE_WS_FWD if kind == "fwd" else SPARSE_WS_BWD).get(head_dim)


# Dense bands (causal masks, windows, context parallelism's shifted bands) through the block-sparse kernels: the
# band as a `BlockMask` run by the warp-specialised persistent block-sparse kernels instead of the dense ones, where
# those measured faster (dev/band_routes.py; docs/performance.md): the forward at D=128 at every causal length and
# window measured, at D=64 from 2048 keys a row; the backward with one kv head per query head (with grouped heads the
# dense backward was the faster one). Measured on an H200; every sm_90 GPU takes the rule (the same SMs run both
# kernels, and both are bound by their math, not by memory bandwidth). A band mask keeps four (query blocks x key
# blocks) int32 lists on the GPU, so bands of more blocks than BAND_SPARSE_MAX_BLOCKS keep the dense kernels (whose
# band costs no memory).
BAND_SPARSE_MAX_BLOCKS = 2**20


def band_via_sparse(kind: str, head_dim: int, width: int, grouped: bool, n_blocks: int) -> bool:
    """Whether a banded call ("fwd" or "bwd") runs the block-sparse kernels: ``width`` is the most keys a query row
    sees, ``grouped`` whether query heads share kv heads, ``n_blocks`` the band mask's query x key blocks."""
    if n_blocks > BAND_SPARSE_MAX_BLOCKS or head_dim not in (64, 128):
        return False
    if kind == "bwd":
        return not grouped
    return head_dim == 128 or width >= 2048


# -- developer overrides: the one place they are read ------------------------------------------------------------
# For kernel developers and tests, never needed to use longctx: force a kernel path or a tile to compare variants.
# Set for a whole process with LONGCTX_TUNING="key=value,key=value" (read once, here) or in code with
# `with tuning.override(key=value): ...`. Keys and their meaning: docs/tuning.md. Unknown keys raise.

# key -> default (None: follow the measured rules of this module)
_OVERRIDE_DEFAULTS: dict = {}
# dense kernels (`longctx.launchers.flash`): run-time autotuning (True; None: the measured tile table); the
# warp-specialised forward / backward forced on or off (None: `ws_fwd_config` / `ws_bwd_config` decide) and their
# configs forced ("128x3x1", or a tuple in code); the atomic-dQ backward forced on or off (None: `atomic_dq`; never
# under deterministic or split); dV and dK in two launches forced on or off (None: `split_dkdv`; on needs "dk" /
# "dv" tile lists at the head dim, or forced tiles); tiles of the Triton kernels forced per kind, no autotuning
# ("fwd:128x64x8x3x1;dq:128x128x8x2", or a dict kind -> tuple in code); tensor-descriptor loads under the
# interpreter (tests of the TMA variants)
_OVERRIDE_DEFAULTS.update(
    autotune=None, ws=None, ws_bwd=None, ws_config=None, ws_bwd_config=None, atomic_dq=None, split_dkdv=None,
    tiles=None, tma_in_interpreter=False,
)  # fmt: skip
# block-sparse kernels (`longctx.launchers.sparse`): False switches the warp-specialised forward / backward off (the
# Triton kernels run, as on other GPUs); tiles of the Triton kernels forced per kind, no autotuning ("fwd:128x64x8x3;
# dkdv:64x128x8x3", or a dict kind -> tuple in code); tensor-descriptor loads under the interpreter (tests; None: as
# `launchers.runtime` decides)
_OVERRIDE_DEFAULTS.update(sparse_ws=None, sparse_ws_bwd=None, sparse_tiles=None, sparse_tma_in_interpreter=None)
# dense bands through the block-sparse kernels (`band_via_sparse`) forced on (True: every band, on any GPU and under
# the interpreter) or off (False)
_OVERRIDE_DEFAULTS.update(band_sparse=None)
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


def ints(value) -> tuple[int, ...] | None:
    """A tuple override as given in code, or parsed from its ``LONGCTX_TUNING`` form "128x3x1"; None stays None."""
    if value is None or isinstance(value, tuple):
        return value
    return tuple(int(x) for x in str(value).split("x"))


def tiles(value) -> dict[str, tuple[int, ...]]:
    """A per-kind tile override as given in code (kind -> tuple), or parsed from "fwd:128x64x8x3;dq:128x128x8x2"."""
    if not value:
        return {}
    if isinstance(value, dict):
        return value
    return {kind.strip(): ints(t) for kind, _, t in (p.partition(":") for p in str(value).split(";") if p.strip())}


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
