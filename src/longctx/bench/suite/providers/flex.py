"""``flex``: FlexAttention with its own ``create_block_mask`` of the same mask_mod.

On CUDA it runs compiled (``torch.compile(flex_attention, dynamic=False)``) with dynamo's recompile limits raised,
so a new mask or length recompiles instead of falling back to the eager path; on the CPU it runs eagerly (the
unfused path, for ``--quick``). Random block-sparse masks are given as their block lists (every kept block full),
as FlexAttention's ``BlockMask.from_kv_blocks``.
"""

from __future__ import annotations

import functools
import warnings

import torch

from longctx.bench.suite.case import KernelCase
from longctx.bench.suite.providers.base import Provider

BLOCK = 128


def flex_available() -> str | None:
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except ImportError:
        return "torch.nn.attention.flex_attention is not in this PyTorch"
    return None


@functools.lru_cache(maxsize=2)
def flex_fn(compiled: bool):
    from torch.nn.attention.flex_attention import flex_attention

    if not compiled:  # the CPU run: eager on purpose (the report names it "flex (eager)"), without torch's warning

        def eager(*args, **kw):
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
                return flex_attention(*args, **kw)

        return eager
    dyn = torch._dynamo.config
    dyn.cache_size_limit = max(dyn.cache_size_limit, 4096)
    if hasattr(dyn, "recompile_limit"):
        dyn.recompile_limit = max(dyn.recompile_limit, 4096)
    if hasattr(dyn, "accumulated_recompile_limit"):
        dyn.accumulated_recompile_limit = max(dyn.accumulated_recompile_limit, 65536)
    if hasattr(dyn, "accumulated_cache_size_limit"):
        dyn.accumulated_cache_size_limit = max(dyn.accumulated_cache_size_limit, 65536)
    return torch.compile(flex_attention, dynamic=False)


def flex_block_mask(case: KernelCase):
    """FlexAttention's block mask of the case's mask (None for the full mask: nothing to skip)."""
    from torch.nn.attention.flex_attention import BlockMask as FlexBlockMask
    from torch.nn.attention.flex_attention import create_block_mask

    m, S = case.mask, case.S
    if m.name == "full":
        return None
    if m.layout is not None:
        lay = m.layout.to(case.device)[None, None]  # (1, 1, n, n)
        num = lay.sum(-1, dtype=torch.int32)
        idx = torch.sort((~lay).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)
        return FlexBlockMask.from_kv_blocks(
            torch.zeros_like(num), idx, num, idx, BLOCK_SIZE=m.block_size, seq_lengths=(S, S)
        )
    return create_block_mask(m.mask_mod, None, None, S, S, device=case.device, BLOCK_SIZE=BLOCK)


class Flex(Provider):
    name = "flex"
    family = "peer"

    def supports(self, case: KernelCase) -> str | None:
        reason = flex_available()
        if reason:
            return reason
        if case.D & (case.D - 1) or case.D < 16:
            return f"head dim {case.D} is not a power of two >= 16"
        if case.torch_dtype == torch.float64:
            return "no float64"
        return None

    def build(self, case: KernelCase):
        fbm = flex_block_mask(case)
        fn = flex_fn(case.device.startswith("cuda"))
        scale, gqa = case.scale, case.Hq != case.Hkv
        return lambda q, k, v: fn(q, k, v, block_mask=fbm, scale=scale, enable_gqa=gqa)

    def backend(self, case, q, k, v) -> str:
        return "flex (compiled)" if case.device.startswith("cuda") else "flex (eager)"

    def no_backward(self, case: KernelCase) -> str | None:
        return None if case.device.startswith("cuda") else "FlexAttention has no backward on the CPU"


PROVIDER = Flex()
