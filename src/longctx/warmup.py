"""`longctx.warmup` and `longctx warmup`: compile, ahead of a run, every attention kernel a model will use.

The kernels take sequence lengths and document layouts as run-time values and their tiles from a table measured per
GPU (`longctx.tuning.MEASURED_TILES`), so a new length or packing does not compile anything once its (head dim,
dtype, mask kind, length bucket) has run. What is left is the first call of each of those, a few seconds of Triton
compilation per kernel with a cold cache. ``warmup`` runs the forward and backward of each (mask, length bucket)
once on small inputs (batch 1) with the launchers recording their launches instead of running them
(`launchers.runtime.compile_ahead`), compiles the distinct kernels concurrently, one thread each (Triton releases
the GIL while it lowers and assembles), then runs every call for real to check that nothing is left to compile.
The kernels land in the process's cache and in Triton's on-disk cache (``TRITON_CACHE_DIR``, default
``~/.triton/cache``), shared by every later process on the machine: run it once per machine (or in a job's
prologue) and training starts without stalls.

    longctx warmup --preset llama-350m --seq-length 65536 --masks causal,documents
    longctx warmup --head-dim 128 --heads 32 --kv-heads 8 --dtype bf16 --masks causal,window --window 4096
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field

import torch

from longctx.units import count_arg

__all__ = ["warmup", "WarmupReport", "MASKS", "main"]

MASKS = ("full", "causal", "window", "documents", "documents_full", "documents_window")
_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
# one length per length bucket of the tile table (`tuning.seq_bucket`): <=1K, 2K, 4K, 8K, 16K, longer
_BUCKET_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)


@dataclass
class WarmupReport:
    """What `warmup` did: ``compile_s``, the wall time of recording the launches and compiling them concurrently;
    ``kernels``, one ``(kernel name, seconds, error or "")`` per distinct kernel compiled (its own compile time,
    overlapping the others'); ``calls``, one ``(mask, length, seconds)`` per forward + backward run afterwards (a
    few milliseconds each unless a kernel was left to compile)."""

    compile_s: float = 0.0
    kernels: list[tuple[str, float, str]] = field(default_factory=list)
    calls: list[tuple[str, int, float]] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return self.compile_s + sum(c[2] for c in self.calls)

    @property
    def failed(self) -> list[tuple[str, str]]:
        """(kernel name, error) of the kernels that did not compile (their launchers fall back where they can)."""
        return [(name, err) for name, _, err in self.kernels if err]

    def table(self) -> str:
        serial = sum(k[1] for k in self.kernels)
        lines = [
            f"compiled {len(self.kernels)} kernels in {self.compile_s:.2f} s "
            f"(their compile times add up to {serial:.2f} s)",
            f"{'mask':<16}{'S':>8}{'seconds':>10}",
        ]
        lines += [f"{m:<16}{s:>8}{t:>10.2f}" for m, s, t in self.calls]
        lines.append(f"{'total':<24}{self.seconds:>10.2f}")
        lines += [f"did not compile: {name}: {err}" for name, err in self.failed]
        return "\n".join(lines)


def _lengths(max_seq_len: int) -> list[int]:
    out = [n for n in _BUCKET_LENGTHS if n <= max_seq_len]
    if max_seq_len > 16384 and 32768 not in out:
        out.append(max(16385, max_seq_len))
    return out or [max_seq_len]


def _plan(masks, lengths: list[int] | None, max_seq_len: int) -> list[tuple[str, int]]:
    """The (mask, length) calls: ``lengths``, else one per bucket up to ``max_seq_len``; in the bucket mode, packed
    documents also at one token less, since a token count that is not a multiple of the block mask's block compiles
    the block-sparse kernels' other variant (EVEN_SK), and packed batches come in every count."""
    plan = []
    for mask in masks:
        for S in list(lengths) if lengths is not None else _lengths(max_seq_len):
            plan.append((mask, S))
            if lengths is None and mask.startswith("documents") and S > 1:
                plan.append((mask, S - 1))
    return plan


def _doc_lengths(total: int, gen: torch.Generator) -> list[int]:
    """Document lengths that fill ``total`` tokens: long-tailed (log-uniform from 16 to total / 2)."""
    lens: list[int] = []
    hi = max(32, total // 2)
    while sum(lens) < total:
        n = int(torch.exp(torch.empty(1).uniform_(2.77, float(torch.log(torch.tensor(float(hi)))), generator=gen)))
        lens.append(min(max(1, n), total - sum(lens)))
    return lens


def _validate(head_dim, n_heads, n_kv_heads, dtype, masks, max_seq_len, window, device) -> torch.device:
    for name, val in (("head_dim", head_dim), ("n_heads", n_heads), ("n_kv_heads", n_kv_heads)):
        if not isinstance(val, int) or isinstance(val, bool) or val < 1:
            raise ValueError(f"{name} must be a positive int, got {val!r}")
    if n_heads % n_kv_heads:
        raise ValueError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")
    if dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"dtype must be torch.bfloat16 or torch.float16 (the GPU kernels' dtypes), got {dtype!r}")
    bad = [m for m in masks if m not in MASKS]
    if bad or not masks:
        raise ValueError(f"masks must be a non-empty list of {MASKS}, got {list(masks)!r}")
    if any(m.endswith("window") for m in masks) and (window is None or int(window) < 0):
        raise ValueError(f"the 'window' mask needs window=<left size in tokens, >= 0>, got {window!r}")
    if not isinstance(max_seq_len, int) or max_seq_len < 16:
        raise ValueError(f"max_seq_len must be an int >= 16, got {max_seq_len!r}")
    dev = torch.device(device) if device is not None else torch.device("cuda")
    if dev.type != "cuda" or not torch.cuda.is_available():
        raise ValueError(f"warmup compiles GPU kernels: device must be a CUDA device with a GPU present, got {dev}")
    return dev


def _call(mask: str, S: int, head_dim, n_heads, n_kv_heads, dtype, window, backend, softcap, dev, gen) -> None:
    """One forward and backward of ``mask`` at length ``S`` (batch 1)."""
    from longctx.api import attention, flash_attn_varlen_func

    win = (int(window), 0) if mask.endswith("window") else (-1, -1)
    if mask.startswith("documents"):
        q = torch.randn(S, n_heads, head_dim, device=dev, dtype=dtype, requires_grad=True)
        k, v = (torch.randn(S, n_kv_heads, head_dim, device=dev, dtype=dtype, requires_grad=True) for _ in range(2))
        lens = _doc_lengths(S, gen)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
        out = flash_attn_varlen_func(
            q, k, v, cu, cu, max(lens), max(lens), causal=mask != "documents_full", window_size=win, softcap=softcap
        )
    else:
        q = torch.randn(1, n_heads, S, head_dim, device=dev, dtype=dtype, requires_grad=True)
        k, v = (torch.randn(1, n_kv_heads, S, head_dim, device=dev, dtype=dtype, requires_grad=True) for _ in range(2))
        out = attention(q, k, v, causal=mask != "full", window=win, backend=backend, softcap=softcap)
    out.float().sum().backward()  # a scalar loss, as training's


def warmup(
    *,
    head_dim: int = 128,
    n_heads: int = 16,
    n_kv_heads: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    masks: tuple[str, ...] | list[str] = ("causal",),
    max_seq_len: int = 32768,
    window: int | None = None,
    device: torch.device | str | None = None,
    backend: str = "auto",
    workers: int | None = None,
    lengths: list[int] | None = None,
    softcap: float = 0.0,
) -> WarmupReport:
    """Compile every kernel that forward and backward attention use for each (mask, length bucket), concurrently.

    Args:
        head_dim, n_heads, n_kv_heads: the model's attention shape (n_kv_heads defaults to n_heads); the kernels
            are compiled for these head counts, as training will call them.
        dtype: torch.bfloat16 or torch.float16.
        masks: any of "full", "causal", "window" (causal sliding window of ``window`` tokens), "documents",
            "documents_full" and "documents_window" (packed documents through `flash_attn_varlen_func`: causal, not
            causal, or causal with the sliding window inside each).
        max_seq_len: the longest sequence training will use; lengths up to it, one per tile-table bucket, run.
        window: the window's left size (keys i - window <= j <= i), for the window masks.
        device: a CUDA device (default: the current one).
        backend: the attention backend of the dense masks, as training calls them ("auto": what dispatch picks;
            "triton" pins longctx's kernels where auto would take cuDNN).
        workers: compile threads (default: one per CPU core, at most 32).
        lengths: the exact lengths to compile for, when a run uses only those (a trainer's fixed sequence length):
            instead of one per length bucket up to ``max_seq_len``.
        softcap: the logit softcap the model's attention uses (0: none; it compiles other kernels).

    Returns:
        A `WarmupReport`: the compile time, each kernel's, and the time of each call once compiled.
    """
    from longctx.launchers.runtime import compile_ahead, compile_launches

    n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
    if workers is not None and (not isinstance(workers, int) or isinstance(workers, bool) or workers < 1):
        raise ValueError(f"workers must be a positive int (compile threads) or None, got {workers!r}")
    if lengths is not None and (
        not isinstance(lengths, (list, tuple))
        or not lengths
        or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in lengths)
    ):
        raise ValueError(
            f"lengths must be a non-empty list of positive ints (or None: one per bucket), got {lengths!r}"
        )
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not softcap >= 0:
        raise ValueError(f"softcap must be a number >= 0 (0: no softcap), got {softcap!r}")
    dev = _validate(head_dim, n_heads, n_kv_heads, dtype, tuple(masks), max_seq_len, window, device)
    plan = _plan(masks, lengths, max_seq_len)
    shape = (head_dim, n_heads, n_kv_heads, dtype, window, backend, float(softcap), dev)
    report = WarmupReport()
    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    with compile_ahead() as launches:
        gen = torch.Generator().manual_seed(0)
        for mask, S in plan:
            _call(mask, S, *shape, gen)
    report.kernels = compile_launches(launches, dev, workers)
    torch.cuda.synchronize(dev)
    report.compile_s = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(0)  # the same packings as recorded
    for mask, S in plan:
        t0 = time.perf_counter()
        _call(mask, S, *shape, gen)
        torch.cuda.synchronize(dev)
        report.calls.append((mask, S, time.perf_counter() - t0))
    return report


def main(argv: list[str] | None = None) -> int:
    """`longctx warmup`: compile the attention kernels a model needs, ahead of training."""
    ap = argparse.ArgumentParser(prog="longctx warmup", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default=None, help="a GPT preset (its heads, kv heads and head dim)")
    ap.add_argument("--head-dim", type=count_arg("--head-dim"), default=None)
    ap.add_argument("--heads", type=count_arg("--heads"), default=None)
    ap.add_argument("--kv-heads", type=count_arg("--kv-heads"), default=None)
    ap.add_argument("--dtype", default="bf16", choices=sorted(_DTYPES))
    ap.add_argument("--masks", default="causal", help=f"comma-separated, of {', '.join(MASKS)}")
    ap.add_argument("--window", type=count_arg("--window"), default=None, help="left window size for the window masks")
    ap.add_argument("--softcap", type=float, default=0.0, help="the attention logit softcap (0: none)")
    ap.add_argument(
        "--seq-length", type=count_arg("--seq-length"), default=32768, help="the longest sequence training will use"
    )
    ap.add_argument("--backend", default="auto", help="the dense masks' attention backend, as training calls it")
    ap.add_argument(
        "--workers", type=count_arg("--workers"), default=None, help="compile threads (default: one per CPU core)"
    )
    args = ap.parse_args(argv)
    head_dim, heads, kv_heads = args.head_dim, args.heads, args.kv_heads
    if args.preset is not None:
        from longctx.models.gpt import GPTConfig

        cfg = GPTConfig.preset(args.preset)
        heads = heads or cfg.num_attention_heads
        kv_heads = kv_heads or cfg.kv_heads
        head_dim = head_dim or cfg.head_dim
    if not torch.cuda.is_available():
        print("longctx warmup: no CUDA GPU here; the kernels compile on the machine that trains", file=sys.stderr)
        return 1
    try:
        report = warmup(
            head_dim=head_dim or 128,
            n_heads=heads or 16,
            n_kv_heads=kv_heads,
            dtype=_DTYPES[args.dtype],
            masks=[m.strip() for m in args.masks.split(",") if m.strip()],
            max_seq_len=args.seq_length,
            window=args.window,
            backend=args.backend,
            workers=args.workers,
            softcap=args.softcap,
        )
    except (ValueError, TypeError) as exc:
        print(f"longctx warmup: {exc}", file=sys.stderr)
        return 2
    print(report.table())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
