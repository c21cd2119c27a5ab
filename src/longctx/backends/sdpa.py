"""Adapters for PyTorch's own fused attention kernels: SDPA (cuDNN, FlashAttention-2, memory-efficient)
and FlexAttention. They are backends when they compute exactly what was asked, and benchmark peers.

Their limits are declared so that auto never routes a case to a kernel that would compute something else:

- SDPA's ``is_causal`` aligns top-left (query i sees keys j <= i). longctx's causal is bottom-right, so only
  bands equal to "dense" or to top-left causal (lo=None, hi=0; i.e. causal with Sq == Sk) are accepted.
  Windows and shifted bands are refused (they would need a dense attn_mask, which defeats the purpose).
- SDPA returns no log-sum-exp: ``return_lse=True`` is refused.
- cuDNN has no deterministic backward: refused under ``deterministic=True`` or
  ``torch.use_deterministic_algorithms(True)``.
- The memory-efficient kernel has no GQA path in SDPA (it would repeat K/V): refused for Hq != Hkv.
- Logit softcapping (``softcap > 0``): SDPA has no score modifier, and longctx does not translate it into
  FlexAttention's ``score_mod``: refused by all of them.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from longctx.backends.base import AttnInputs, Backend
from longctx.masks import Band

_HALF = (torch.float16, torch.bfloat16)


def _sdpa_band_reasons(band: Band) -> tuple[list[str], bool]:
    """Reasons SDPA cannot express ``band``, and whether it is SDPA's (top-left) is_causal."""
    if band.is_dense:
        return [], False
    if band.lo is None and band.hi == 0:
        return [], True
    return ["SDPA expresses only no mask or top-left causal (causal needs Sq == Sk, no window, no shifted band)"], False


class _SDPABackend(Backend):
    family = "peer"
    sdpa_backend_name = ""
    dtypes: tuple[torch.dtype, ...] = _HALF
    max_head_dim = 256
    supports_gqa = True
    deterministic_ok = True
    min_capability = (8, 0)

    def available(self) -> tuple[bool, str]:
        try:
            from torch.nn.attention import SDPBackend  # noqa: F401
        except ImportError:  # pragma: no cover - old torch
            return False, "torch.nn.attention.SDPBackend is not available in this PyTorch"
        return True, ""

    def not_supported_reasons(self, inp: AttnInputs) -> list[str]:
        r = []
        if inp.device.type != "cuda":
            r.append(f"needs a CUDA device, got {inp.device.type}")
        elif inp.capability is not None and inp.capability < self.min_capability:
            r.append(f"needs compute capability >= {self.min_capability}, got {inp.capability}")
        if inp.dtype not in self.dtypes:
            r.append(f"dtype {inp.dtype} not in {[str(d) for d in self.dtypes]}")
        if inp.head_dim % 8 != 0 or inp.head_dim > self.max_head_dim:
            r.append(f"head_dim {inp.head_dim} must be a multiple of 8 and <= {self.max_head_dim}")
        if not self.supports_gqa and inp.hq != inp.hkv:
            r.append("no GQA/MQA support (would repeat K/V)")
        r += _sdpa_band_reasons(inp.band)[0]
        if inp.return_lse:
            r.append("SDPA does not return the log-sum-exp")
        if inp.block_mask or inp.varlen:
            r.append("no block-sparse or packed-document support")
        if (inp.deterministic or torch.are_deterministic_algorithms_enabled()) and not self.deterministic_ok:
            r.append("no deterministic backward")
        if inp.softcap:
            r.append(f"no logit softcapping in SDPA (got softcap={inp.softcap})")
        return r

    def run(
        self, q, k, v, *, scale: float, band: Band, return_lse: bool, deterministic=False, block_mask=None, softcap=0.0
    ):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if softcap:
            raise ValueError(f"backend {self.name!r} has no logit softcapping (got softcap={softcap}); use 'auto'")

        is_causal = _sdpa_band_reasons(band)[1]
        kernel = getattr(SDPBackend, self.sdpa_backend_name)
        try:
            with sdpa_kernel([kernel]):
                out = F.scaled_dot_product_attention(
                    q, k, v, is_causal=is_causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
                )
        except RuntimeError as e:
            if "No available kernel" not in str(e):
                raise
            raise ValueError(
                f"backend {self.name!r}: PyTorch's {self.sdpa_backend_name} kernel refused these inputs "
                f"(q {tuple(q.shape)} {q.dtype}, strides {q.stride()}); use backend='auto'. PyTorch said: {e}"
            ) from e
        return out, None


class SDPACuDNN(_SDPABackend):
    name = "sdpa_cudnn"
    family = "fused"
    description = "cuDNN fused attention through torch SDPA"
    sdpa_backend_name = "CUDNN_ATTENTION"
    deterministic_ok = False
    min_capability = (9, 0)  # PyTorch enables cuDNN attention by default only from Hopper on


class SDPAFlash(_SDPABackend):
    name = "sdpa_flash"
    description = "FlashAttention-2 through torch SDPA"
    sdpa_backend_name = "FLASH_ATTENTION"


class SDPAEfficient(_SDPABackend):
    name = "sdpa_efficient"
    description = "memory-efficient (xformers-style) attention through torch SDPA"
    sdpa_backend_name = "EFFICIENT_ATTENTION"
    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    supports_gqa = False
    min_capability = (5, 0)


@functools.lru_cache(maxsize=64)
def _flex_block_mask(lo: int | None, hi: int | None, sq: int, sk: int, device: str):
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q_idx, kv_idx):
        d = kv_idx - q_idx
        keep = d == d  # all-true of the right shape
        if lo is not None:
            keep = keep & (d >= lo)
        if hi is not None:
            keep = keep & (d <= hi)
        return keep

    return create_block_mask(mask_mod, None, None, sq, sk, device=device)


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    import torch._dynamo
    from torch.nn.attention.flex_attention import flex_attention

    # Each new shape or mask recompiles; never let dynamo give up and fall back to the (slow) eager path.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 1024)
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 1024)
    return torch.compile(flex_attention, dynamic=False)


class FlexBackend(Backend):
    name = "flex"
    family = "peer"
    description = "FlexAttention (torch.compile-generated Triton kernels)"

    def available(self) -> tuple[bool, str]:
        try:
            from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
        except ImportError:
            return False, "torch.nn.attention.flex_attention is not available in this PyTorch"
        return True, ""

    def not_supported_reasons(self, inp: AttnInputs) -> list[str]:
        r = []
        if inp.device.type != "cuda":
            r.append("longctx uses FlexAttention only on CUDA")
        if inp.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            r.append(f"dtype {inp.dtype} not supported")
        if inp.head_dim not in (16, 32, 64, 128):
            r.append(f"head_dim {inp.head_dim} not in (16, 32, 64, 128)")
        if inp.deterministic:
            r.append("no documented deterministic backward")
        if inp.block_mask or inp.varlen:
            r.append("longctx block masks are not translated to FlexAttention's")
        if inp.softcap:
            r.append(f"logit softcapping is not translated to FlexAttention's score_mod (got softcap={inp.softcap})")
        return r

    def run(
        self, q, k, v, *, scale: float, band: Band, return_lse: bool, deterministic=False, block_mask=None, softcap=0.0
    ):
        if softcap:
            raise ValueError(f"backend 'flex' has no logit softcapping here (got softcap={softcap}); use 'auto'")
        bm = None
        if not band.is_dense:
            bm = _flex_block_mask(band.lo, band.hi, q.shape[2], k.shape[2], str(q.device))
            if q.shape[1] != k.shape[1] and q.shape[2] != k.shape[2]:
                # Inductor finds no FlexAttention kernel for grouped heads under a block mask with Sq != Sk
                # (NoValidChoicesError, torch 2.11); the same call with K/V repeated per query head compiles
                k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        out, lse = _compiled_flex()(
            q, k, v, block_mask=bm, scale=scale, enable_gqa=q.shape[1] != k.shape[1], return_lse=True
        )
        # FlexAttention marks rows with no visible key by lse -inf and output 0, as longctx does.
        return out, lse.float()
