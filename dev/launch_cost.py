"""Where an attention call's host time goes, without a profiler's distortion: for each path of
`dev/attention_host.py` (and the fused position-wise kernels), the host time of one forward + backward, split into

- ``launches_us``: the Triton launches themselves, each replayed alone ``kernel[grid](*args, **kwargs)`` as the
  launcher made it (recorded with `longctx.launchers.runtime.compile_ahead`);
- ``direct_us``: the same launches through their compiled kernels' own launcher (``CompiledKernel.run``, what
  Triton calls after its specialisation and cache lookup: the floor a launch path in Python can reach);
- ``rest_us``: the call with its launches recorded and not run: longctx's Python, torch's allocations and the
  autograd engine.

    PYTHONPATH=src python dev/launch_cost.py [--tokens 2048] [--calls 300] [--out cost.json]
"""

from __future__ import annotations

import argparse
import json

import torch


def _direct(kernel, grid, args, kwargs):
    """A function launching ``kernel`` as Triton's ``run`` does once the compiled kernel is found; None where this
    Triton's internals differ."""
    try:
        from triton.runtime import driver

        compiled = kernel.warmup(*args, grid=grid, **kwargs)
        device = driver.active.get_current_device()
        binder = kernel.device_caches[device][4]
        bound, _, _ = binder(*args, **kwargs)
        values = list(bound.values())
        g = grid(bound) if callable(grid) else grid
        g = tuple(g) + (1,) * (3 - len(g))
        stream = driver.active.get_current_stream(device)
        run, fn, meta = compiled.run, compiled.function, compiled.packed_metadata
        return lambda: run(g[0], g[1], g[2], stream, fn, meta, None, None, None, *values)
    except Exception as exc:  # noqa: BLE001 - a measurement, not a feature
        print(f"direct launch of {getattr(kernel, '__name__', kernel)} unavailable: {type(exc).__name__}: {exc}")
        return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import longctx

    # the same timing and calls as attention_host.py (dev/ is the script's directory)
    from attention_host import _per_call_us as _host_us
    from attention_host import inputs
    from longctx.launchers import runtime
    from longctx.ops import pointwise

    T = args.tokens
    q, k, v, cu, (q4, k4, v4), bm = inputs(T)
    x = torch.randn(1, T, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    paths = {
        "varlen (packed documents)": (
            lambda: longctx.flash_attn_varlen_func(q, k, v, cu, cu, T, T, causal=True), q),
        "attention, block_mask": (lambda: longctx.attention(q4, k4, v4, block_mask=bm), q4),
        "attention, causal, triton": (lambda: longctx.attention(q4, k4, v4, causal=True, backend="triton"), q4),
        "attention, window 256, triton": (
            lambda: longctx.attention(q4, k4, v4, causal=True, window=(255, 0), backend="triton"), q4),
        "rms_norm": (lambda: pointwise.rms_norm(x, w, 1e-5), x),
    }  # fmt: skip
    rows = []
    for name, (fn, _) in paths.items():
        do = torch.randn_like(fn())

        def call(fn=fn, do=do):
            torch.autograd.backward(fn(), do)

        with torch.autograd.set_multithreading_enabled(False):  # the backward's launches on this thread
            total = _host_us(call, args.calls)
            with runtime.compile_ahead() as launches:
                call()
            recorded = list(launches)
            n = len(recorded)

            def call_recorded(call=call):
                with runtime.compile_ahead():
                    call()

            rest = _host_us(call_recorded, args.calls)
        each, direct = [], []
        for kernel, grid, a, kw in recorded:
            each.append(_host_us(lambda kernel=kernel, grid=grid, a=a, kw=kw: kernel[grid](*a, **kw), args.calls))
            d = _direct(kernel, grid, a, kw)
            direct.append(_host_us(d, args.calls) if d is not None else float("nan"))
        row = {
            "path": name,
            "total_us": round(total, 1),
            "rest_us": round(rest, 1),
            "launches": n,
            "launches_us": round(sum(each), 1),
            "direct_us": round(sum(direct), 1),
            "each_launch_us": [
                (getattr(kn, "__name__", str(kn)), round(e, 1), round(d, 1), len(a) + len(kw))
                for (kn, _, a, kw), e, d in zip(recorded, each, direct)
            ],
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
