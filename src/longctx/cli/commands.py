"""What the `longctx info`, `longctx check` and `longctx demo-memory` commands do."""

from __future__ import annotations

import math
import platform
import sys
import time

import torch

from longctx.api import attention
from longctx.dispatch import AttnInputs, backend_names, get_backend, reasons_for
from longctx.masks import Band
from longctx.memory.measure import peak_live_bytes, saved_bytes
from longctx.reference.naive import naive_attention

__all__ = ["info", "check", "demo_memory", "check_cases", "error_vs_oracle", "failing", "tolerance_floor"]


def _versions() -> dict[str, str]:
    v = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        import triton

        v["triton"] = triton.__version__
    except ImportError:
        v["triton"] = "not installed"
    if torch.cuda.is_available():
        v["cuda"] = str(torch.version.cuda)
        v["cudnn"] = str(torch.backends.cudnn.version())
    return v


def info() -> int:
    """Print the versions, the GPUs and, for each backend, whether it runs causal attention at D=128 here.

    Returns:
        0.
    """
    import longctx

    print(f"longctx {longctx.__version__}")
    for k, val in _versions().items():
        print(f"  {k:8s} {val}")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            cap = torch.cuda.get_device_capability(i)
            print(
                f"  gpu {i}    {p.name}, compute capability {cap[0]}.{cap[1]}, "
                f"{p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs"
            )
            from longctx.launchers.runtime import tile_row_line

            print(f"  tiles    {tile_row_line(i)[1]}")
        device = torch.device("cuda")
    else:
        print("  gpu      none (CUDA not available): CPU backends only")
        device = torch.device("cpu")
    print("backends (auto-selection order):")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    probe = AttnInputs(device, dtype, 1, 8, 8, 1024, 1024, 128, Band.from_args(1024, 1024, True), True)
    for name in backend_names():
        be = get_backend(name)
        reasons = reasons_for(be, probe)
        state = "usable" if not reasons else "not usable: " + "; ".join(reasons)
        print(f"  {name:15s} {be.description}")
        print(f"  {'':15s} for causal {dtype} D=128 on {device.type}: {state}")
    return 0


# -- check: every backend against the float64 oracle --


def check_cases(device: torch.device) -> list[dict]:
    """A small matrix of shapes and masks covering MHA/GQA/MQA, causal with Sq != Sk and windows.

    Args:
        device: where the cases will run (the matrix is the same on every device).

    Returns:
        One dict per case: name, B, Hq, Hkv, Sq, Sk, D, causal, window.
    """
    return [
        dict(name="MHA dense", B=2, Hq=4, Hkv=4, Sq=128, Sk=128, D=64, causal=False, window=None),
        dict(name="MHA causal", B=2, Hq=4, Hkv=4, Sq=256, Sk=256, D=64, causal=True, window=None),
        dict(name="GQA causal Sq<Sk", B=1, Hq=8, Hkv=2, Sq=100, Sk=173, D=64, causal=True, window=None),
        dict(name="MQA causal Sq>Sk", B=1, Hq=4, Hkv=1, Sq=150, Sk=97, D=40, causal=True, window=None),
        dict(name="GQA window (32,8)", B=1, Hq=4, Hkv=2, Sq=200, Sk=200, D=72, causal=False, window=(32, 8)),
    ]


def tolerance_floor(dtype: torch.dtype) -> float:
    """The absolute error allowed on top of twice plain PyTorch's error in ``dtype`` (the check's rule)."""
    return {torch.float64: 1e-10, torch.float32: 2e-5}.get(dtype, 2e-3)


def error_vs_oracle(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    run,
    *,
    scale: float,
    band: Band,
    with_lse: bool = True,
) -> tuple[dict[str, float], dict[str, float]]:
    """Max-abs errors of ``run`` and of plain PyTorch in the input dtype, both against the float64 oracle.

    Args:
        q: (B, Hq, Sq, D); k, v: (B, Hkv, Sk, D); do: the output gradient, (B, Hq, Sq, D).
        run: ``run(q, k, v) -> (out, lse | None)``, the attention under test.
        scale: softmax scale; band: the mask, as for the oracle.
        with_lse: whether ``run`` returns an lse worth comparing (else its error is ``None``).

    Returns:
        ``(ours, plain_pytorch)``: dicts of max-abs errors with keys out, lse, dq, dk, dv. An error is NaN or inf
        when the result holds NaN or inf where the oracle is finite; it is ``None`` only for the lse of a ``run``
        that returns none.
    """

    def grads(fn, qq, kk, vv):
        qq, kk, vv = (t.detach().clone().requires_grad_(True) for t in (qq, kk, vv))
        out, lse = fn(qq, kk, vv)
        out.backward(do.to(out.dtype))
        return out.detach(), (None if lse is None else lse.detach()), qq.grad, kk.grad, vv.grad

    ref = grads(
        lambda a, b, c: naive_attention(a, b, c, scale=scale, band=band, upcast=torch.float64),
        q.double(),
        k.double(),
        v.double(),
    )
    pt = grads(lambda a, b, c: naive_attention(a, b, c, scale=scale, band=band, upcast=q.dtype), q, k, v)
    ours = grads(run, q, k, v)
    names = ("out", "lse", "dq", "dk", "dv")

    def err(x, r):
        if x is None:  # a missing gradient, or an lse asked for and not returned
            return float("nan")
        x, r = x.double(), r.double()
        both_inf = torch.isinf(x) & torch.isinf(r) & (torch.sign(x) == torch.sign(r))
        d = torch.where(both_inf, torch.zeros_like(x), (x - r).abs())
        if not d.numel():
            return 0.0
        return float("nan") if bool(d.isnan().any()) else float(d.max())

    e_ours = {n: err(a, r) for n, a, r in zip(names, ours, ref)}
    e_pt = {n: err(a, r) for n, a, r in zip(names, pt, ref)}
    if not with_lse:
        e_ours["lse"] = e_pt["lse"] = None
    return e_ours, e_pt


def failing(ours: dict[str, float | None], pt: dict[str, float | None], dtype: torch.dtype) -> list[str]:
    """The quantities that break the check's rule: error <= 2 x plain PyTorch's error + floor, and finite.

    Only a quantity not compared (``None``: the lse of a backend that returns none) is skipped; a NaN or inf
    error, which is what a NaN or inf result gives, fails.
    """
    floor = tolerance_floor(dtype)
    return [n for n, e in ours.items() if e is not None and not (math.isfinite(e) and e <= 2 * pt[n] + floor)]


def check(device: str | None = None, seed: int | None = None) -> int:
    """Run every usable backend on fresh random inputs against the float64 oracle; print a table.

    Args:
        device: "cpu" or "cuda" (None: cuda if available).
        seed: seed of the random inputs (None: the clock).

    Returns:
        0 when every row passes, 1 otherwise.
    """
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtypes = [torch.bfloat16, torch.float16] if dev.type == "cuda" else [torch.float32]
    gen = torch.Generator(device="cpu").manual_seed(seed if seed is not None else int(time.time()))
    print(
        f"longctx check on {dev} ({', '.join(str(d).replace('torch.', '') for d in dtypes)}); errors are max |x - ref|"
    )
    print("rule: pass if error <= 2 x (plain PyTorch error in the same dtype) + floor, for out, lse, dq, dk, dv")
    header = (
        f"{'backend':15s} {'dtype':9s} {'case':22s} {'out':>9s} {'lse':>9s} {'dq':>9s} {'dk':>9s} {'dv':>9s}  result"
    )
    print(header)
    print("-" * len(header))
    failures = 0
    for dtype in dtypes:
        for case in check_cases(dev):
            B, Hq, Hkv, Sq, Sk, D = (case[x] for x in ("B", "Hq", "Hkv", "Sq", "Sk", "D"))

            def rnd(*shape, dtype=dtype):
                return torch.randn(*shape, generator=gen).to(device=dev, dtype=dtype)

            q, k, v, do = rnd(B, Hq, Sq, D), rnd(B, Hkv, Sk, D), rnd(B, Hkv, Sk, D), rnd(B, Hq, Sq, D)
            band = Band.from_args(Sq, Sk, case["causal"], case["window"])
            scale = D**-0.5
            for name in backend_names():
                be = get_backend(name)
                with_lse = True
                inp = AttnInputs.from_tensors(q, k, band=band, return_lse=True, needs_grad=True)
                reasons = reasons_for(be, inp)
                if reasons and not reasons_for(be, AttnInputs.from_tensors(q, k, band=band, needs_grad=True)):
                    with_lse = False  # the backend runs, but returns no lse: check the rest
                    reasons = []
                if reasons:
                    continue

                def run(a, b, c, name=name, with_lse=with_lse, case=case):
                    kw = dict(causal=case["causal"], window=case["window"], backend=name, return_lse=with_lse)
                    res = attention(a, b, c, **kw)
                    return res if with_lse else (res, None)

                dname = str(dtype).replace("torch.", "")
                try:
                    ours, pt = error_vs_oracle(q, k, v, do, run, scale=scale, band=band, with_lse=with_lse)
                except Exception as exc:  # a backend that fails here is a failing row, not the end of the check
                    failures += 1
                    first = str(exc).strip().splitlines()[0][:120] if str(exc).strip() else ""
                    cells = " ".join(f"{'-':>9s}" for _ in range(5))
                    print(f"{name:15s} {dname:9s} {case['name']:22s} {cells}  ERROR ({type(exc).__name__}: {first})")
                    continue
                bad = failing(ours, pt, dtype)
                failures += bool(bad)
                cells = " ".join(f"{'-':>9s}" if ours[n] is None else f"{ours[n]:9.2e}" for n in ours)
                status = "ok" if not bad else "FAIL (" + ", ".join(bad) + ")"
                print(f"{name:15s} {dname:9s} {case['name']:22s} {cells}  {status}")
    print(f"{'all backends agree with the oracle' if not failures else f'{failures} failing rows'}")
    return 1 if failures else 0


def demo_memory(lengths: list[int], device: str | None = None) -> int:
    """Print bytes saved for backward and peak memory of forward+backward: tiled vs math, at growing lengths.

    Args:
        lengths: sequence lengths S to measure.
        device: "cpu" or "cuda" (None: cuda if available).

    Returns:
        0.
    """
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    B, H, D = 1, 8, 64
    print(f"memory of causal attention forward+backward, B={B} H={H} D={D} {dtype} on {dev}")
    print("saved = bytes autograd keeps for backward; peak = peak live bytes during forward+backward, inputs excluded")
    print(f"{'S':>7s} | {'tiled saved':>12s} {'tiled peak':>12s} | {'math saved':>12s} {'math peak':>12s} | math/tiled")
    for S in lengths:
        row = {}
        for name in ("tiled", "math"):
            q, k, v = (torch.randn(B, H, S, D, device=dev, dtype=dtype, requires_grad=True) for _ in range(3))

            def fwd(name=name, q=q, k=k, v=v):
                return attention(q, k, v, causal=True, backend=name)

            def fwd_bwd(fwd=fwd):
                fwd().sum().backward()

            row[name] = (saved_bytes(fwd), peak_live_bytes(fwd_bwd))
        (ts, tp), (ms, mp) = row["tiled"], row["math"]
        mib = 2**20
        tiled_cells = f"{ts / mib:9.1f} MiB {tp / mib:8.1f} MiB"
        math_cells = f"{ms / mib:9.1f} MiB {mp / mib:8.1f} MiB"
        print(f"{S:7d} | {tiled_cells} | {math_cells} | {mp / tp:6.1f}x")
        sys.stdout.flush()
    print("tiled grows linearly with S (it saves q, k, v, out, lse); math grows with S^2 (it saves the probabilities).")
    return 0
