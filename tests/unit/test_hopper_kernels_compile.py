"""CPU checks of the warp-specialised kernels: which inputs take the forward (`kernels.flash_fwd_ws`), and that
it and the backward (`kernels.flash_bwd_ws`) compile for sm_90a within shared memory, with their register budgets
and no spills beyond the known ones (Triton compiles for a GPU target without one; cuobjdump ships with Triton).

The kernels themselves run only on Hopper GPUs: tests/gpu/test_hopper_forward.py, test_hopper_backward.py and
test_flash_kernels.py run them.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest
import torch

from longctx import tuning
from longctx.launchers import flash as tf
from longctx.launchers import runtime


@pytest.mark.parametrize(
    "D,S,lo,hi,expected",
    [
        (128, 16384, False, False, tuning.WS_CONFIG[128]),
        (128, 1024, False, False, tuning.WS_CONFIG[128]),  # dense: faster at every length measured
        (128, 8192, False, True, tuning.WS_CONFIG[128]),
        (128, 4096, False, True, tuning.WS_CONFIG_SHORT_CAUSAL[128]),
        (128, 2048, False, True, None),  # short causal: the Triton forward measured faster
        (128, 8192, True, True, tuning.WS_CONFIG[128]),  # windows / shifted bands: like causal
        (64, 8192, False, False, tuning.WS_CONFIG[64]),
        (64, 16384, False, True, None),  # D=64 with a band: the Triton forward
        (256, 16384, False, False, tuning.WS_CONFIG[256]),
        (256, 1024, False, True, tuning.WS_CONFIG[256]),  # D=256: faster at every length and band measured
        (96, 4096, False, False, None),
    ],
)
def test_ws_config_rule(D, S, lo, hi, expected):
    assert tuning.ws_fwd_config(D, S, S, lo or hi) == expected
    assert tf._ws_config(D, S, S, lo, hi) == expected  # what the launcher takes, with no override set


def test_ws_not_taken_on_cpu_tensors():
    q = torch.randn(1, 2, 256, 128, dtype=torch.bfloat16)
    assert not tf._ws_ok(q, q, q)


@pytest.fixture
def sm90_compile():
    """Offline compilation of a Gluon kernel for sm_90a with the launchers' options (num_warps=4, maxnreg=168):
    ``compile(fn, consts, descs, types)``; ``descs`` maps the descriptor arguments to the launcher's own host TMA
    descriptors (specialised here as the JIT would), ``types`` the other non-constexpr arguments to their types
    (i32 where absent). Skips where this Triton lacks the internals it uses."""
    triton = pytest.importorskip("triton")
    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend, GPUTarget
        from triton.experimental.gluon._runtime import GluonASTSource
    except ImportError as exc:  # another Triton version: the internals this test uses moved
        pytest.skip(f"Triton internals for offline compilation not found: {exc}")

    def compile_(fn, consts: dict, descs: dict, types: dict):
        # constexprs the case does not name take their defaults, as in a launch (e.g. SOFTCAP = False)
        defaults = {p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}
        consts = {**defaults, **consts}
        sig = {}
        for name in fn.arg_names:
            if name in consts:
                sig[name] = "constexpr"
            elif name in descs:
                sig[name] = native_specialize_impl(BaseBackend, descs[name], False, True, True)[0]
            else:
                sig[name] = types.get(name, "i32")
        src = GluonASTSource(fn=fn, signature=sig, constexprs=consts)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": 168})

    return compile_


def _check_resources(k, tmp_path) -> list[tuple[int, int]]:
    """Shared memory within an H100 block, the setmaxnreg budgets, at most 168 registers; returns (STACK, LOCAL)
    in bytes per function of the cubin Triton assembled (either > 0: spills to local memory)."""
    import triton

    assert k.metadata.shared <= 232448, "more shared memory than an H100 block can have"
    # register reallocation between the partitions (setmaxnreg): 240 for the consumer worker, 24 for the producer
    budgets = {int(n) for n in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", k.asm["ptx"])}
    assert {240, 24} <= budgets, budgets
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        pytest.skip("no cuobjdump in this Triton installation")
    cubin = tmp_path / "k.cubin"
    cubin.write_bytes(k.asm["cubin"])
    res = subprocess.run([tool, "-res-usage", str(cubin)], capture_output=True, text=True, check=True).stdout
    usage = re.findall(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", res)
    assert usage and all(int(reg) <= 168 for reg, _, _ in usage), res
    return [(int(stack), int(local)) for _, stack, local in usage]


@pytest.mark.slow
@pytest.mark.parametrize("D,causal", [(128, True), (64, False), (256, True)])
def test_ws_compiles_for_sm90_without_spills(D, causal, tmp_path, sm90_compile):
    from longctx.kernels.gluon import flash_fwd_ws as ws

    block_n, stages, pipe = tuning.ws_fwd_config(D, 8192, 8192, causal)
    t = torch.empty(1, 1, 256, D, dtype=torch.bfloat16)
    consts = dict(HEAD_DIM=D, BLOCK_D=D, HAS_LO=False, HAS_HI=causal, LONGEST_FIRST=causal, BLOCK_N=block_n,
                  STAGES=stages, PIPE=pipe, CONSUMER_REGS=240, PRODUCER_REGS=24)  # fmt: skip
    descs = {"desc_q": runtime._gluon_desc(t, int(ws.WG_ROWS)), "desc_k": runtime._gluon_desc(t, block_n),
             "desc_v": runtime._gluon_desc(t, block_n)}  # fmt: skip
    k = sm90_compile(ws.attn_fwd_ws_kernel, consts, descs, {"O": "*bf16", "LSE": "*fp32", "qk_scale": "fp32"})
    usage = _check_resources(k, tmp_path)
    assert all(stack <= FWD_STACK_BOUND[D] and local == 0 for stack, local in usage), usage


# Stack bytes allowed in the forward's cubin. D=256 (its 64 x 256 fp32 output tile takes 128 registers a thread):
# 512 bytes with Triton 3.6 and 400 with 3.9 in this signature, where every integer argument is an i32; compiled
# as the JIT specialises a contiguous launch (dev/sass_diff.py), it spills nothing.
FWD_STACK_BOUND = {64: 0, 128: 0, 256: 512}


# Stack bytes allowed in the backward's cubin. D=128 is known to spill: measured 432 bytes dense, 424 causal (Triton
# 3.6, this signature, where every integer argument is an i32; the JIT, which makes unit strides and GROUP = 1
# constants, got 88 for a contiguous MHA launch). More than the bound: the kernel spills more than it did, a
# regression to look at.
BWD_STACK_BOUND = {64: 0, 128: 512}


@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
@pytest.mark.parametrize("D", [64, 128])
def test_ws_bwd_compiles_for_sm90(D, causal, tmp_path, sm90_compile):
    from longctx.kernels.gluon import flash_bwd_ws as ws

    block_m, stages, early_dv = tuning.ws_bwd_config(D)
    block_n = int(ws.WG_ROWS) * int(ws.NUM_CONSUMERS)
    t = torch.empty(1, 1, 256, D, dtype=torch.bfloat16)
    # lse2 / Delta: (B, Hq, Sq padded to 4) float32
    desc_rows = runtime._gluon_rows_desc(torch.empty(1, 1, 256, dtype=torch.float32), block_m)
    consts = dict(BLOCK_D=D, HAS_LO=False, HAS_HI=causal, BLOCK_M=block_m, STAGES=stages, EARLY_DV=early_dv,
                  CONSUMER_REGS=240, PRODUCER_REGS=24)  # fmt: skip
    descs = {"desc_q": runtime._gluon_desc(t, block_m), "desc_k": runtime._gluon_desc(t, block_n),
             "desc_v": runtime._gluon_desc(t, block_n), "desc_do": runtime._gluon_desc(t, block_m),
             "desc_lse2": desc_rows, "desc_delta": desc_rows, "desc_dqa": _dqa_desc(D, block_m)}  # fmt: skip
    types = {"DK": "*bf16", "DV": "*bf16", "DQA": "*fp32", "qk_scale": "fp32", "sm_scale": "fp32"}
    k = sm90_compile(ws.attn_bwd_ws_kernel, consts, descs, types)
    usage = _check_resources(k, tmp_path)
    assert all(local == 0 for _, local in usage), usage
    assert all(stack <= BWD_STACK_BOUND[D] for stack, _ in usage), usage
    _check_dq_by_bulk_reduction(k)


# Stack bytes allowed in the D=256 dK/dV kernels' cubins (dense and block-sparse): 384-408 with Triton 3.6 in this
# signature (every integer argument an i32), in the second consumer's loop and the epilogues' 64-bit pointers. More:
# a regression to look at.
BWD_D256_STACK_BOUND = 512


@pytest.mark.slow
@pytest.mark.parametrize("causal,softcap", [(False, False), (True, False), (True, True)])
def test_ws_bwd_d256_compiles_for_sm90(causal, softcap, tmp_path, sm90_compile):
    """`kernels.flash_bwd_ws_d256`: K, V, the Q / dO ring and the P^T / dS^T exchange within an H100 block's shared
    memory, the register budgets, no local memory beyond the stack bound."""
    from longctx.kernels.gluon import flash_bwd_ws_d256 as ws

    _, stages, _ = tuning.ws_bwd_config(256)
    t = torch.empty(1, 1, 256, 256, dtype=torch.bfloat16)
    consts = dict(BLOCK_D=256, HAS_LO=False, HAS_HI=causal, STAGES=stages, CONSUMER_REGS=240, PRODUCER_REGS=24,
                  SOFTCAP=softcap)  # fmt: skip
    descs = {name: runtime._gluon_desc(t, int(ws.BLOCK_M)) for name in ("desc_q", "desc_k", "desc_v", "desc_do")}
    types = {"LSE2": "*fp32", "DELTA": "*fp32", "DK": "*bf16", "DV": "*bf16", "qk_scale": "fp32", "sm_scale": "fp32",
             "softcap_scale": "fp32"}  # fmt: skip
    k = sm90_compile(ws.attn_bwd_dkdv_ws_d256_kernel, consts, descs, types)
    usage = _check_resources(k, tmp_path)
    assert all(local == 0 and stack <= BWD_D256_STACK_BOUND for stack, local in usage), usage


def _dqa_desc(D: int, block_m: int):
    """The launchers' descriptor of the float32 dQ accumulator (B, Hq, Sq, D)."""
    return tf._dqa_desc(torch.empty(1, 1, 256, D, dtype=torch.float32), block_m, D)


def _check_dq_by_bulk_reduction(k) -> None:
    """dQ leaves the backward by the copy engine's bulk reduction, never by element atomics."""
    ptx = k.asm["ptx"]
    assert "cp.reduce.async.bulk.tensor" in ptx and ".add" in ptx
    # (the persistent kernels' one integer atomic is their work ticket)
    assert not re.search(r"\b(red|atom)\.global[\w.]*\.(f32|v2\.f32)", ptx), "element atomics in the backward"


# the mask arguments of the block-sparse kernels: pointers (the rest are i32)
_SPARSE_TYPES = {"O": "*bf16", "desc_o": "*bf16", "LSE": "*fp32", "DK": "*bf16", "DV": "*bf16",
                 "DQA": "*fp32", "TILES": "*u8", "TR": "*i64", "qk_scale": "fp32", "sm_scale": "fp32"}  # fmt: skip
_SPARSE_TYPES.update({n: "*i32" for n in ("KV_NUM", "KV_IDX", "Q_NUM", "Q_IDX", "FULL_NUM", "FULL_IDX", "QDOC",
                                          "KDOC", "QPOS", "KPOS", "TILE_IDS", "SCHED", "CNT")})  # fmt: skip


# Stack bytes allowed in the block-sparse kernels (this signature, the persistent kernels). Measured with Triton 3.6:
# the forward spills 176 bytes at D=128 with every part of the analytic rule on (documents and global rows /
# columns; 16 in interval form; 224 with Triton 3.9), 104 at D=64; the backward 160 at D=128, 24 at D=64. The
# spills sit in the per-item code (the item's lists, pointers and epilogue), not in the tile loops (SASS read
# offline). More than the bound: the kernels spill more than they did, a regression to look at.
SPARSE_STACK_BOUND = {
    ("fwd", 64): 128,
    ("fwd", 128): 256,
    ("fwd", 256): 256,
    ("bwd", 64): 64,
    ("bwd", 128): BWD_STACK_BOUND[128],
}


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind,even", [(1, True), (2, False), (3, False)], ids=["analytic-even", "tiles-ragged", "intervals-ragged"]
)
@pytest.mark.parametrize("D", [64, 128, 256])
def test_sparse_ws_compiles_for_sm90(D, kind, even, tmp_path, sm90_compile):
    """The block-sparse warp-specialised kernels (`kernels.flash_sparse_ws`) with the configs of
    `tuning.sparse_ws_config`, within shared memory and the stack bounds above (D=256: the backward is
    `flash_bwd_ws_d256`'s block-sparse dK/dV kernel)."""
    from longctx import tuning
    from longctx.kernels.gluon import flash_sparse_ws as ws

    t = torch.empty(1, 1, 256, D, dtype=torch.bfloat16)
    mask = dict(MASK_BS=128, MASK_KIND=kind, HAS_DOC=kind in (1, 3), HAS_GLOBAL=kind == 1)
    block_n, stages, pipe = tuning.sparse_ws_config("fwd", D)
    consts = dict(BLOCK_D=D, EVEN_SK=even, BLOCK_N=block_n, STAGES=stages, PIPE=pipe, CONSUMER_REGS=240,
                  PRODUCER_REGS=24, **mask)  # fmt: skip
    descs = {"desc_q": runtime._gluon_desc(t, int(ws.WG_ROWS)), "desc_k": runtime._gluon_desc(t, block_n),
             "desc_v": runtime._gluon_desc(t, block_n), "desc_o": runtime._gluon_desc(t, int(ws.WG_ROWS))}  # fmt: skip
    usage = _check_resources(sm90_compile(ws.sparse_fwd_ws_kernel, consts, descs, _SPARSE_TYPES), tmp_path)
    assert all(local == 0 and stack <= SPARSE_STACK_BOUND["fwd", D] for stack, local in usage), usage

    if D == 256:  # the backward: `flash_bwd_ws_d256`'s block-sparse dK/dV kernel
        from longctx.kernels.gluon import flash_bwd_ws_d256 as wide

        descs = {name: runtime._gluon_desc(t, int(wide.BLOCK_M)) for name in ("desc_q", "desc_k", "desc_v", "desc_do")}
        consts = dict(BLOCK_D=D, EVEN=even, STAGES=tuning.sparse_ws_config("bwd", D)[1], CONSUMER_REGS=240,
                      PRODUCER_REGS=24, **mask)  # fmt: skip
        types = {**_SPARSE_TYPES, "LSE2": "*fp32", "DELTA": "*fp32", "softcap_scale": "fp32"}
        usage = _check_resources(sm90_compile(wide.sparse_bwd_dkdv_ws_d256_kernel, consts, descs, types), tmp_path)
        assert all(local == 0 and stack <= BWD_D256_STACK_BOUND for stack, local in usage), usage
        return
    block_m, stages, early_dv = tuning.sparse_ws_config("bwd", D)
    rows = int(ws.CTA_ROWS)
    desc_rows = runtime._gluon_rows_desc(torch.empty(1, 1, 256, dtype=torch.float32), block_m)
    consts = dict(BLOCK_D=D, EVEN=even, BLOCK_M=block_m, STAGES=stages, EARLY_DV=early_dv, CONSUMER_REGS=240,
                  PRODUCER_REGS=24, **mask)  # fmt: skip
    descs = {"desc_q": runtime._gluon_desc(t, block_m), "desc_k": runtime._gluon_desc(t, rows),
             "desc_v": runtime._gluon_desc(t, rows),
             "desc_do": runtime._gluon_desc(t, block_m), "desc_lse2": desc_rows, "desc_delta": desc_rows,
             "desc_dqa": _dqa_desc(D, block_m), "desc_dk": runtime._gluon_desc(t, int(ws.WG_ROWS)),
             "desc_dv": runtime._gluon_desc(t, int(ws.WG_ROWS))}  # fmt: skip
    k = sm90_compile(ws.sparse_bwd_ws_kernel, consts, descs, _SPARSE_TYPES)
    usage = _check_resources(k, tmp_path)
    assert all(local == 0 and stack <= SPARSE_STACK_BOUND["bwd", D] for stack, local in usage), usage
    _check_dq_by_bulk_reduction(k)


@pytest.mark.slow
@pytest.mark.parametrize("D", [64, 128])
def test_sparse_ws_backward_compiles_with_float32_dkdv(D, tmp_path, sm90_compile):
    """Float32 dK / dV (context parallelism's partial sums) leave the block-sparse backward from registers
    (DKDV_16BIT=False: the descriptor slots take the gradient pointers as placeholders), within the same bounds."""
    from longctx import tuning
    from longctx.kernels.gluon import flash_sparse_ws as ws

    t = torch.empty(1, 1, 256, D, dtype=torch.bfloat16)
    block_m, stages, early_dv = tuning.sparse_ws_config("bwd", D)
    desc_rows = runtime._gluon_rows_desc(torch.empty(1, 1, 256, dtype=torch.float32), block_m)
    consts = dict(BLOCK_D=D, EVEN=False, BLOCK_M=block_m, STAGES=stages, EARLY_DV=early_dv, CONSUMER_REGS=240,
                  PRODUCER_REGS=24, MASK_BS=128, MASK_KIND=3, HAS_DOC=True, HAS_GLOBAL=False,
                  DKDV_16BIT=False)  # fmt: skip
    descs = {"desc_q": runtime._gluon_desc(t, block_m), "desc_k": runtime._gluon_desc(t, int(ws.CTA_ROWS)),
             "desc_v": runtime._gluon_desc(t, int(ws.CTA_ROWS)), "desc_do": runtime._gluon_desc(t, block_m),
             "desc_lse2": desc_rows, "desc_delta": desc_rows, "desc_dqa": _dqa_desc(D, block_m)}  # fmt: skip
    types = {**_SPARSE_TYPES, "DK": "*fp32", "DV": "*fp32", "desc_dk": "*fp32", "desc_dv": "*fp32"}
    k = sm90_compile(ws.sparse_bwd_ws_kernel, consts, descs, types)
    usage = _check_resources(k, tmp_path)
    assert all(local == 0 and stack <= FP32_DKDV_STACK_BOUND[D] for stack, local in usage), usage


# Stack bytes of the block-sparse backward with float32 dK / dV (the epilogue's register stores in the 64-row
# layout): 192 at D=64, 832 at D=128 with Triton 3.9, offline. More: a regression to look at.
FP32_DKDV_STACK_BOUND = {64: 256, 128: 1024}


def test_sparse_tile_choices_and_forced_tiles():
    """`tuning.sparse_tile_choices`: the sparse table first, only tiles dividing the mask block, a square fallback;
    the ``sparse_tiles`` override parsed from text or taken as a dict; unknown kinds raise."""
    from longctx import tuning
    from longctx.launchers import sparse as ts

    assert tuning.sparse_tile_choices("fwd", 128, 128)[0] == tuning.SPARSE_TABLES["fwd"][128][0]
    assert all(128 % bm == 0 and 128 % bn == 0 for bm, bn, _, _ in tuning.sparse_tile_choices("dq", 64, 128))
    assert tuning.sparse_tile_choices("fwd", 128, 48) == [(16, 16, 4, 2)]
    assert tuning.sparse_tile_choices("fwd", 128, 32, interpret=True) == [(16, 16, 4, 1)]
    assert ts._forced_tiles() == {}
    with tuning.override(sparse_tiles="fwd:128x64x8x3;dkdv:32x128x8x3"):
        assert ts._forced_tiles() == {"fwd": (128, 64, 8, 3), "dkdv": (32, 128, 8, 3)}
    with tuning.override(sparse_tiles={"dq": [64, 64, 4, 2]}):
        assert ts._forced_tiles() == {"dq": (64, 64, 4, 2)}
    with tuning.override(sparse_tiles="bwd:1x2x3x4"), pytest.raises(ValueError, match="sparse_tiles"):
        ts._forced_tiles()


def test_sparse_ws_switched_off_by_tuning_key():
    """``sparse_ws`` / ``sparse_ws_bwd`` False: no warp-specialised config, whatever the inputs (CPU tensors never
    take one either)."""
    from longctx import tuning
    from longctx.launchers import sparse as ts

    q = torch.empty(1, 2, 256, 128, dtype=torch.bfloat16)
    assert ts._ws_config("fwd", 2, 128, q, q, q) is None  # CPU tensors
    with tuning.override(sparse_ws=False, sparse_ws_bwd=False):
        assert tuning.get("sparse_ws") is False and ts._ws_config("bwd", 2, 128, q, q, q, q) is None
    assert tuning.sparse_ws_config("fwd", 128) == tuning.SPARSE_WS_FWD[128]
    assert tuning.sparse_ws_config("bwd", 96) is None


def test_sparse_ws_schedule_puts_the_longest_items_first_within_each_head():
    """`triton_sparse._schedule`: a permutation of the work items, heads in order, and within each head work
    non-increasing, the tiles' own order where work is equal (packed documents: the first key blocks of the long
    document come first)."""
    import longctx
    import longctx.masks as bsm
    from longctx.launchers import sparse as ts

    S, B, Hq, Hkv = 2048, 2, 4, 2
    ids = torch.repeat_interleave(torch.arange(3), torch.tensor([256, 1536, 256]))
    bm = longctx.block_mask(bsm.document_mask(ids) & bsm.causal_mask, None, None, S, S, block_size=128)
    args, _ = ts._mask_args(bm.kernel_tensors(), bm.kernel_meta(), B, Hq, transposed=True)
    n_tiles = S // 128
    order = ts._schedule(args[0], args[2], n_tiles, 128, 128, Hq // Hkv).long()
    assert order.dtype == torch.long and sorted(order.tolist()) == list(range(B * Hkv * n_tiles))
    work = (args[0] + args[2]).reshape(B, Hkv, Hq // Hkv, -1).sum(2).reshape(-1)[order]
    head = order // n_tiles
    assert bool((head[:-1] <= head[1:]).all()), "heads in order"
    for h in range(B * Hkv):
        w, pos = work[head == h], order[head == h]
        assert bool((w[:-1] >= w[1:]).all()), "most work first within a head"
        assert bool(((w[:-1] > w[1:]) | (pos[:-1] < pos[1:])).all()), "stable where work is equal"
    assert order[0].item() == 2  # key block 2 (first of the long document) of batch 0, kv head 0: 12 blocks x 2


def test_sparse_ws_schedule_is_kept_per_mask_and_recomputed_when_it_changes():
    """`triton_sparse._schedule_cached`: the same mask tensors and arguments give the kept order (no recomputation),
    another group or an in-place change of the mask's counts gives a new one, equal to `_schedule`'s."""
    import longctx
    from longctx.launchers import sparse as ts

    ts._SCHEDULES.clear()
    lay = torch.rand(2, 8, 8, generator=torch.Generator().manual_seed(0)) < 0.4
    bm = longctx.BlockMask.from_layout(lay, 128)
    args, _ = ts._mask_args(bm.kernel_tensors(), bm.kernel_meta(), 1, 2, transposed=False)
    first = ts._schedule_cached(args[0], args[2], 8, 128, 128, 1)
    assert ts._schedule_cached(args[0], args[2], 8, 128, 128, 1) is first
    assert torch.equal(first, ts._schedule(args[0], args[2], 8, 128, 128, 1))
    other = ts._schedule_cached(args[0], args[2], 8, 128, 128, 2)
    assert other is not first and torch.equal(other, ts._schedule(args[0], args[2], 8, 128, 128, 2))
    bm.kernel_tensors()[2].zero_()  # the full-block counts change in place: a new version
    again = ts._schedule_cached(args[0], args[2], 8, 128, 128, 1)
    assert again is not first and torch.equal(again, ts._schedule(args[0], args[2], 8, 128, 128, 1))
    for _ in range(ts._SCHEDULES_MAX + 5):  # bounded
        ts._schedule_cached(args[0], args[2], 8, 1 + len(ts._SCHEDULES), 128, 1)
    assert len(ts._SCHEDULES) <= ts._SCHEDULES_MAX
