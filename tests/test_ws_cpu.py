"""CPU checks of the warp-specialised forward (`kernels.flash_fwd_ws`): which inputs take it, and that it compiles
for sm_90a without spilling (Triton compiles for a GPU target without one; cuobjdump ships with Triton).

The kernel itself runs only on Hopper GPUs: tests/gpu/test_ws_gpu.py and tests/gpu/test_triton_gpu.py run it.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest
import torch

from longctx.ops import triton_flash as tf


@pytest.mark.parametrize(
    "D,S,lo,hi,expected",
    [
        (128, 16384, False, False, tf.WS_CONFIG[128]),
        (128, 1024, False, False, tf.WS_CONFIG[128]),  # dense: faster at every length measured
        (128, 8192, False, True, tf.WS_CONFIG[128]),
        (128, 4096, False, True, tf.WS_CONFIG_SHORT_CAUSAL[128]),
        (128, 2048, False, True, None),  # short causal: the Triton forward measured faster
        (128, 8192, True, True, tf.WS_CONFIG[128]),  # windows / shifted bands: like causal
        (64, 8192, False, False, tf.WS_CONFIG[64]),
        (64, 16384, False, True, None),  # D=64 with a band: the Triton forward
        (256, 16384, False, False, None),  # no config: the Triton forward
        (96, 4096, False, False, None),
    ],
)
def test_ws_config_rule(D, S, lo, hi, expected):
    assert tf._ws_config(D, S, S, lo, hi) == expected


def test_ws_not_taken_on_cpu_tensors():
    q = torch.randn(1, 2, 256, 128, dtype=torch.bfloat16)
    assert not tf._ws_ok(q, q, q)


def _compile(D: int, causal: bool, block_n: int, stages: int, pipe: bool):
    triton = pytest.importorskip("triton")
    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend, GPUTarget
        from triton.experimental.gluon._runtime import GluonASTSource
    except ImportError as exc:  # another Triton version: the internals this test uses moved
        pytest.skip(f"Triton internals for offline compilation not found: {exc}")
    from longctx.kernels import flash_fwd_ws as ws

    t = torch.empty(1, 1, 256, D, dtype=torch.bfloat16)

    def desc(rows):  # the launcher's own descriptor, specialised as the JIT would
        return native_specialize_impl(BaseBackend, tf._gluon_desc(t, rows), False, True, True)[0]

    consts = dict(HEAD_DIM=D, BLOCK_D=D, HAS_LO=False, HAS_HI=causal, LONGEST_FIRST=causal, BLOCK_N=block_n,
                  STAGES=stages, PIPE=pipe, CONSUMER_REGS=240, PRODUCER_REGS=24)  # fmt: skip
    sig = {}
    for name in ws.attn_fwd_ws_kernel.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name == "desc_q":
            sig[name] = desc(int(ws.WG_ROWS))
        elif name in ("desc_k", "desc_v"):
            sig[name] = desc(block_n)
        else:
            sig[name] = {"O": "*bf16", "LSE": "*fp32", "qk_scale": "fp32"}.get(name, "i32")
    src = GluonASTSource(fn=ws.attn_fwd_ws_kernel, signature=sig, constexprs=consts)
    return triton, triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": 168})


@pytest.mark.slow
@pytest.mark.parametrize("D,causal", [(128, True), (64, False)])
def test_ws_compiles_for_sm90_without_spills(D, causal, tmp_path):
    cfg = tf.WS_CONFIG[D]
    triton, k = _compile(D, causal, *cfg)
    assert k.metadata.shared <= 232448, "more shared memory than an H100 block can have"
    # the cubin Triton assembled: its resource usage (LOCAL > 0 or STACK > 0 would mean spills to local memory)
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        pytest.skip("no cuobjdump in this Triton installation")
    cubin = tmp_path / "k.cubin"
    cubin.write_bytes(k.asm["cubin"])
    res = subprocess.run([tool, "-res-usage", str(cubin)], capture_output=True, text=True, check=True).stdout
    usage = re.findall(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", res)
    assert usage and all(int(reg) <= 168 and stack == "0" and local == "0" for reg, stack, local in usage), res
    # register reallocation between the partitions (setmaxnreg): 240 for the consumer worker, 24 for the producer
    budgets = {int(n) for n in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", k.asm["ptx"])}
    assert {240, 24} <= budgets, budgets
