"""Backend registry, automatic selection, `explain()` and the environment switches.

Each backend declares what it supports by answering ``not_supported_reasons(inputs) -> list[str]``
(empty = supported). ``backend="auto"`` walks the priority list and takes the first backend with no
reasons; ``explain()`` prints the walk. A backend pinned by name (argument or ``LONGCTX_ATTN_BACKEND``)
that cannot run raises with its reasons; auto falls back quietly.

The user switches it honours (the backend pin, the flash and fused families) are read by `longctx.switches`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from longctx import switches
from longctx.backends.base import AttnInputs, Backend

__all__ = [
    "AttnInputs",
    "Backend",
    "BackendChoice",
    "register_backend",
    "get_backend",
    "backend_names",
    "select_backend",
    "disabled_reason",
]


_REGISTRY: dict[str, Backend] = {}
_PRIORITY: list[str] = []  # auto-selection order, best first (`_ensure_loaded` fills it)


def _builtin_backends() -> list[Backend]:
    """The built-in backends in auto order, best first. cuDNN is the fastest kernel wherever it can compute the
    request (no mask, or causal with Sq == Sk; no lse; not deterministic), so it comes first; longctx's Triton kernels
    serve everything it cannot (bottom-right causal with Sq != Sk, windows, shifted bands, lse, block masks, the
    deterministic backward); the plain-PyTorch backends run anywhere. The measurements behind the order:
    docs/performance.md."""
    from longctx.backends import math, sdpa, tiled, triton, triton_sparse

    return [
        sdpa.SDPACuDNN(),
        triton.TritonBackend(),
        triton_sparse.TritonSparseBackend(),
        sdpa.SDPAFlash(),
        sdpa.FlexBackend(),
        sdpa.SDPAEfficient(),
        tiled.TiledBackend(),
        math.MathBackend(),
    ]


def register_backend(backend: Backend, *, priority: int | None = None) -> Backend:
    """Add a backend to the registry, at index ``priority`` of the auto order (default: last)."""
    if not isinstance(backend, Backend) or not backend.name:
        raise ValueError(f"expected a longctx.backends.base.Backend with a non-empty name, got {backend!r}")
    _ensure_loaded()
    _REGISTRY[backend.name] = backend
    if backend.name not in _PRIORITY:
        _PRIORITY.insert(len(_PRIORITY) if priority is None else priority, backend.name)
    return backend


def _ensure_loaded() -> None:
    # The backend modules import Triton's launchers and FlexAttention: loaded on first use to keep `import longctx`
    # light.
    if _PRIORITY:
        return
    for backend in _builtin_backends():
        _REGISTRY[backend.name] = backend
        _PRIORITY.append(backend.name)


def backend_names() -> list[str]:
    _ensure_loaded()
    return [n for n in _PRIORITY if n in _REGISTRY]


def get_backend(name: str) -> Backend:
    _ensure_loaded()
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; expected 'auto' or one of {backend_names()}")
    return _REGISTRY[name]


def disabled_reason(backend: Backend) -> str | None:
    """Why an environment switch turns this backend off, or None."""
    if backend.family == "flash":
        off = switches.flash_disabled()
        if off:
            return f"disabled by {off}"
    if backend.name == "sdpa_cudnn":
        off = switches.fused_disabled()
        if off:
            return f"disabled by {off}"
    return None


def reasons_for(backend: Backend, inp: AttnInputs, *, honour_switches: bool = True) -> list[str]:
    ok, why = backend.available()
    if not ok:
        return [why]
    reasons = []
    if honour_switches:
        off = disabled_reason(backend)
        if off:
            reasons.append(off)
    reasons.extend(backend.not_supported_reasons(inp))
    return reasons


@dataclass
class BackendChoice:
    """The result of a selection: the backend, how it was chosen, and every other backend's reasons."""

    backend: Backend
    how: str  # "auto", "argument" or "LONGCTX_ATTN_BACKEND"
    rejected: dict[str, list[str]] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"selected: {self.backend.name} ({self.how})"]
        if self.backend.description:
            lines[0] += f" - {self.backend.description}"
        for name, reasons in self.rejected.items():
            lines.append(f"  {name}: " + "; ".join(reasons))
        return "\n".join(lines)


def select_backend(requested: str, inp: AttnInputs) -> BackendChoice:
    """Pick the backend for ``inp``; raises ValueError if a pinned backend cannot run it."""
    _ensure_loaded()
    if not isinstance(requested, str):
        raise TypeError(f"backend must be a string, got {type(requested).__name__}")
    how = "argument"
    env = switches.pinned_backend()
    if requested == "auto" and env:
        requested, how = env, "LONGCTX_ATTN_BACKEND"
    if requested != "auto":
        backend = get_backend(requested)
        # A pin is an explicit request: switches still apply, so a pinned-but-disabled backend raises.
        reasons = reasons_for(backend, dataclasses.replace(inp, pinned=True))
        if reasons:
            raise ValueError(
                f"attention backend {requested!r} (chosen by {how}) cannot run these inputs: "
                + "; ".join(reasons)
                + ". Use backend='auto' to fall back to one that can; longctx.explain(...) shows the options."
            )
        return BackendChoice(backend, how)
    rejected: dict[str, list[str]] = {}
    chosen = None
    for name in backend_names():
        backend = _REGISTRY[name]
        if chosen is not None:
            rejected[name] = ["lower priority than " + chosen.name]
            continue
        reasons = reasons_for(backend, inp)
        if reasons:
            rejected[name] = reasons
        else:
            chosen = backend
    if chosen is None:  # math supports everything it is validated for; this is a bug if reached
        raise ValueError("no attention backend supports these inputs:\n" + str(rejected))
    return BackendChoice(chosen, "auto", rejected)
