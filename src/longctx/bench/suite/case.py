"""What one measurement is about (`KernelCase`), what it gave (a result row) and the result codes."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from longctx.masks import BlockMask, MaskCase

# Result codes: every (provider, mask, S) row has exactly one.
OK = "ok"
OOM = "oom"  # torch.OutOfMemoryError (or an allocator failure): recorded, the cache emptied, the run goes on
UNSUPPORTED = "unsupported"  # the provider cannot compute this mask / shape / device (the reason says why)
ERROR = "error"  # anything else the provider raised (the message is kept)
SKIPPED = "skipped"  # not run: a size cap of a slow reference, or the run's time budget spent
CODES = (OK, OOM, UNSUPPORTED, ERROR, SKIPPED)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}

# The row's columns, in the CSV's order.
COLUMNS = (
    "mode",
    "provider",
    "mask",
    "label",
    "seed",
    "S",
    "B",
    "Hq",
    "Hkv",
    "D",
    "dtype",
    "world",
    "method",
    "kept_area",
    "kept_fraction",
    "fwd_ms",
    "bwd_ms",
    "fwd_bwd_ms",
    "fwd_tflops",
    "bwd_tflops",
    "peak_extra_mib",
    "code",
    "reason",
    "backend",
)


class Unsupported(Exception):
    """Raised by a provider's ``build`` when it finds out late that it cannot run the case."""


@dataclass(eq=False)
class KernelCase:
    """One (mask, shape) point of kernel mode: q (B, Hq, S, D), k and v (B, Hkv, S, D) on ``device``.

    ``layout="bshd"`` keeps the inputs in flash_attn_func's (B, S, H, D) memory, as transposed views.
    """

    mask: MaskCase
    B: int
    Hq: int
    Hkv: int
    D: int
    dtype: str
    device: str
    layout: str = "bhsd"
    _bm: BlockMask | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.layout not in ("bhsd", "bshd"):
            raise ValueError(f"layout must be 'bhsd' or 'bshd', got {self.layout!r}")

    @property
    def S(self) -> int:
        return self.mask.S

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def scale(self) -> float:
        return self.D**-0.5

    def fwd_flops(self) -> float:
        """LongCA's convention: 4 x kept area x Hq x D per batch element."""
        return 4.0 * self.mask.kept_area() * self.B * self.Hq * self.D

    def bwd_flops(self) -> float:
        return 2.5 * self.fwd_flops()

    def block_mask(self) -> BlockMask:
        """longctx's block mask of this case's mask on its device (built once, shared by the longctx providers)."""
        if self._bm is None:
            self._bm = self.mask.block_mask(self.device)
        return self._bm

    def inputs(self, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Random q (B, Hq, S, D), k and v (B, Hkv, S, D) (views of (B, S, H, D) memory for ``layout="bshd"``)."""
        g = torch.Generator(device=self.device).manual_seed(seed)
        kw = {"generator": g, "device": self.device, "dtype": self.torch_dtype}

        def make(h: int) -> torch.Tensor:
            if self.layout == "bshd":
                return torch.randn(self.B, self.S, h, self.D, **kw).transpose(1, 2)
            return torch.randn(self.B, h, self.S, self.D, **kw)

        return make(self.Hq), make(self.Hkv), make(self.Hkv)

    def row(self, provider: str, **kw) -> dict:
        """A result row with this case's columns filled in."""
        r = {c: None for c in COLUMNS}
        r.update(
            mode="kernel",
            provider=provider,
            mask=self.mask.name,
            label=self.mask.label,
            seed=self.mask.params.get("seed"),
            S=self.S,
            B=self.B,
            Hq=self.Hq,
            Hkv=self.Hkv,
            D=self.D,
            dtype=self.dtype,
            world=1,
            method="",
            kept_area=self.mask.kept_area(),
            kept_fraction=self.mask.kept_fraction(),
            code=OK,
            reason="",
            backend="",
        )
        r.update(kw)
        return r
