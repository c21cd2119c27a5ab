"""Energy per call of the block-sparse kernels (NVML's energy counter), for issue 4's 5x question: is the 10%
layout's time against causal's set by the board's power cap rather than by idle cycles (benchmarks/NOTES.md,
session 12)?

For each case, the calls run back to back for ``--secs`` seconds after a warm-up, and NVML is read (nothing is
set): the energy counter before and after, and meanwhile, every 10 ms, the SM clock, the power draw and the
clock-event reasons (the software power cap among them). Cases: the 10% block layout, causal and (``diag``)
one block per query tile, through `triton_sparse` (forward; backward with its side passes), at ``--s`` with
``--hkv`` key/value heads (1 is MQA: the same blocks and items, a sixteenth of the K/V bytes), optionally in
CUDA graphs (``--graph``: no host time between the calls); and calibrations: a device copy (energy per byte
moved), a bf16 matmul (energy per FLOP) and the idle board. Keep ``--secs`` at 2-3 or more: a 0.5 s run gave
energies off by tens of percent (the counter's updates are coarse, the power manager not yet settled).

    python benchmarks/energy.py [--s 16384] [--hkv 16] [--secs 3] [--cases layout,causal,diag,copy,mm,idle]
                                [--sides fwd,bwd] [--graph 20] [--json out.json]
    python benchmarks/energy.py --summary out.json   # the rows, and energy = fixed + per kept block
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from diag_items import _kept_blocks, _profile, _table_masks  # noqa: E402

# NVML clock-event (throttle) reason bits
_REASONS = {
    0x1: "idle",
    0x2: "app_clocks",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x20: "sw_thermal",
    0x40: "hw_thermal",
    0x80: "hw_power_brake",
}


class Nvml:
    """Read-only NVML through ctypes (the driver's library; no Python package needed)."""

    def __init__(self, cuda_index: int = 0):
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        self._ok(self.lib.nvmlInit_v2())
        self.h = ctypes.c_void_p()
        try:
            key = ("GPU-" + str(torch.cuda.get_device_properties(cuda_index).uuid)).encode()
        except Exception:  # an older torch: the index (one GPU machines agree on it)
            key = b""
        if not key or self.lib.nvmlDeviceGetHandleByUUID(key, ctypes.byref(self.h)) != 0:
            self._ok(self.lib.nvmlDeviceGetHandleByIndex_v2(cuda_index, ctypes.byref(self.h)))
        name = "nvmlDeviceGetCurrentClocksEventReasons"
        self._reasons_fn = getattr(self.lib, name, None) or self.lib.nvmlDeviceGetCurrentClocksThrottleReasons

    @staticmethod
    def _ok(rc: int) -> None:
        if rc != 0:
            raise RuntimeError(f"NVML call failed with code {rc}")

    def _u(self, fn, *args, kind=ctypes.c_uint) -> int:
        x = kind()
        self._ok(fn(self.h, *args, ctypes.byref(x)))
        return int(x.value)

    def energy_mj(self) -> int:
        return self._u(self.lib.nvmlDeviceGetTotalEnergyConsumption, kind=ctypes.c_ulonglong)

    def power_w(self) -> float:
        return self._u(self.lib.nvmlDeviceGetPowerUsage) / 1000

    def limit_w(self) -> float:
        return self._u(self.lib.nvmlDeviceGetEnforcedPowerLimit) / 1000

    def sm_mhz(self) -> int:
        return self._u(self.lib.nvmlDeviceGetClockInfo, 1)  # NVML_CLOCK_SM

    def max_sm_mhz(self) -> int:
        return self._u(self.lib.nvmlDeviceGetMaxClockInfo, 1)

    def temp_c(self) -> int:
        return self._u(self.lib.nvmlDeviceGetTemperature, 0)

    def reasons(self) -> int:
        return self._u(self._reasons_fn, kind=ctypes.c_ulonglong)


class _Sampler(threading.Thread):
    def __init__(self, nv: Nvml, period: float = 0.01):
        super().__init__(daemon=True)
        self.nv, self.period, self.rows, self.stop = nv, period, [], threading.Event()

    def run(self):
        while not self.stop.is_set():
            self.rows.append((self.nv.sm_mhz(), self.nv.power_w(), self.nv.reasons()))
            time.sleep(self.period)


def graphed(fn, n: int):
    """``fn`` run ``n`` times in one CUDA graph (no host time between the calls): the replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    torch.cuda.synchronize()
    return g.replay


def measure(nv: Nvml, fn, secs: float, warm_secs: float = 1.0, per: int = 1) -> dict:
    """Energy and time per call of ``fn`` run back to back, with the clock / power / reasons seen meanwhile (``fn``
    makes ``per`` calls, e.g. a graph's replay). ``host_share``: the share of the time the host took to issue
    them; near 1 the loop is host-bound and the GPU idles between calls."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t_fn = max((time.perf_counter() - t0) / 3, 1e-5)
    for _ in range(max(1, int(warm_secs / t_fn))):  # steady clocks and power before the count starts
        fn()
    torch.cuda.synchronize()
    n = max(5, int(secs / t_fn))
    s = _Sampler(nv)
    e0, t0 = nv.energy_mj(), time.perf_counter()
    s.start()
    for _ in range(n):
        fn()
    t_issue = time.perf_counter()
    torch.cuda.synchronize()
    t1, e1 = time.perf_counter(), nv.energy_mj()
    s.stop.set()
    s.join()
    mhz = [r[0] for r in s.rows]
    watts = [r[1] for r in s.rows]
    cap = sum(1 for r in s.rows if r[2] & 0x4) / max(1, len(s.rows))
    seen = 0
    for r in s.rows:
        seen |= r[2]
    return {
        "calls": n * per,
        "ms_per_call": 1000 * (t1 - t0) / n / per,
        "mj_per_call": (e1 - e0) / n / per,
        "host_share": (t_issue - t0) / (t1 - t0),
        "watts": (e1 - e0) / 1000 / (t1 - t0),
        "sm_mhz_median": statistics.median(mhz) if mhz else None,
        "sm_mhz_min": min(mhz) if mhz else None,
        "watts_sampled_median": statistics.median(watts) if watts else None,
        "power_cap_share": cap,
        "reasons_seen": [name for bit, name in _REASONS.items() if seen & bit],
        "temp_c": nv.temp_c(),
    }


def fit(rows: list[dict], target: float = 5.0) -> dict:
    """Per side (fwd / bwd): energy per call = fixed + per_block * kept blocks, through the 10% layout and causal
    rows; the ratios of causal's time and energy to the layout's; and the largest fixed part (mJ) that would give
    causal / layout = ``target`` at the same per-block energy."""
    by = {r["case"]: r for r in rows if "mj_per_call" in r}
    out = {}
    for side in ("fwd", "bwd"):
        lay, cau = by.get(f"layout {side}"), by.get(f"causal {side}")
        if lay is None or cau is None:
            continue
        per = (cau["mj_per_call"] - lay["mj_per_call"]) / (cau["blocks"] - lay["blocks"])
        fixed = lay["mj_per_call"] - per * lay["blocks"]
        out[side] = {
            "uj_per_block": 1000 * per,
            "fixed_mj": fixed,
            "fixed_share_of_layout": fixed / lay["mj_per_call"],
            "time_ratio": cau["ms_per_call"] / lay["ms_per_call"],
            "energy_ratio": cau["mj_per_call"] / lay["mj_per_call"],
            "block_ratio": cau["blocks"] / lay["blocks"],
            "fixed_mj_for_target": cau["mj_per_call"] / target - per * lay["blocks"],
        }
        diag = by.get(f"diag {side}")
        if diag is not None:
            out[side]["diag_fixed_mj"] = diag["mj_per_call"] - per * diag["blocks"]
    return out


def summary(path: str) -> None:
    """The rows of a ``--json`` file, one line each, and `fit`."""
    with open(path) as f:
        d = json.load(f)
    print(json.dumps(d["head"]))
    for r in d["rows"]:
        if "error" in r:
            print(f"{r['case']:16s} {r['error']}")
            continue
        print(
            f"{r['case']:16s} {r['ms_per_call']:9.4f} ms {r['mj_per_call']:9.1f} mJ {r['watts']:5.0f} W "
            f"{r['sm_mhz_median']:6.0f} MHz  power cap {100 * r['power_cap_share']:3.0f}%"
        )
    for side, x in fit(d["rows"]).items():
        print(f"{side}: " + ", ".join(f"{k} {v:.4g}" for k, v in x.items()))


def _gpu_ms(fn, n: int = 5) -> float:
    """Milliseconds of GPU kernels per call (profiler), to tell a host-bound loop from a GPU-bound one."""
    return sum(_profile(fn, n).values()) / 1000


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--s", type=int, default=16384)
    ap.add_argument("--hkv", type=int, default=16)
    ap.add_argument("--secs", type=float, default=3.0)
    ap.add_argument("--cases", default="layout,causal,copy,mm,idle")
    ap.add_argument("--sides", default="fwd,bwd", help="of the attention cases")
    ap.add_argument("--graph", type=int, default=0, help="the attention calls in CUDA graphs of this many calls")
    ap.add_argument("--tag", default="")
    ap.add_argument("--json", default=None)
    ap.add_argument("--summary", default=None, help="print a --json file's rows and fit, and exit")
    args = ap.parse_args(argv)
    if args.summary:
        summary(args.summary)
        return 0
    import longctx
    from longctx.launchers import sparse as ts

    nv = Nvml(torch.cuda.current_device())
    S, H, D, Hkv = args.s, 16, 128, args.hkv
    n = S // 128
    scale = D**-0.5
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, H, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(1, Hkv, S, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    table = _table_masks(S, H)
    masks = {
        "layout": table["layout 10%"],
        "causal": table["causal"],
        # one block per query tile (the diagonal): a call that reads Q, K, V and writes O once, with 1 tile per item
        "diag": longctx.BlockMask.from_layout(torch.eye(n, dtype=torch.bool, device="cuda")[None], 128, S, S),
    }
    head = {
        "gpu": torch.cuda.get_device_name(),
        "tag": args.tag,
        "S": S,
        "H": H,
        "Hkv": Hkv,
        "D": D,
        "power_limit_w": nv.limit_w(),
        "max_sm_mhz": nv.max_sm_mhz(),
    }
    print(json.dumps(head), flush=True)
    rows = []
    which = args.cases.split(",")
    for name in ("layout", "causal", "diag"):
        if name not in which:
            continue
        bm = masks[name]
        blocks = _kept_blocks(bm, H)
        out, lse = ts.sparse_forward(q, k, v, scale=scale, block_mask=bm)
        do = torch.randn_like(out)
        fns = {
            "fwd": lambda bm=bm: ts.sparse_forward(q, k, v, scale=scale, block_mask=bm),
            "bwd": lambda bm=bm, out=out, lse=lse, do=do: ts.sparse_backward(
                do, q, k, v, out, lse, scale=scale, block_mask=bm
            ),
        }
        for side, fn in fns.items():
            if side not in args.sides.split(","):
                continue
            r = {"case": f"{name} {side}", "blocks": blocks, "graph": args.graph}
            try:
                r["gpu_ms_per_call"] = _gpu_ms(fn)
                if args.graph:
                    r.update(measure(nv, graphed(fn, args.graph), args.secs, per=args.graph))
                else:
                    r.update(measure(nv, fn, args.secs))
                r["uj_per_block"] = 1000 * r["mj_per_call"] / blocks
            except Exception as exc:  # report and go on
                r["error"] = f"{type(exc).__name__}: {exc}"[:300]
            rows.append(r)
            print(json.dumps(r), flush=True)
    if "copy" in which:
        src = torch.empty(64 * 2**20, device="cuda", dtype=torch.bfloat16)  # 128 MiB, read and written once
        dst = torch.empty_like(src)
        r = {"case": "copy 128 MiB", "bytes_moved": 2 * src.numel() * 2}
        r.update(measure(nv, lambda: dst.copy_(src), args.secs))
        r["mj_per_gb"] = r["mj_per_call"] / (r["bytes_moved"] / 1e9)
        rows.append(r)
        print(json.dumps(r), flush=True)
        del src, dst
    if "mm" in which:
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        b = torch.randn_like(a)
        r = {"case": "matmul 8192^3", "flops": 2 * 8192**3}
        r.update(measure(nv, lambda: a @ b, args.secs))
        r["pj_per_flop"] = 1e9 * r["mj_per_call"] / r["flops"]
        r["tflops"] = r["flops"] / r["ms_per_call"] / 1e9
        rows.append(r)
        print(json.dumps(r), flush=True)
    if "idle" in which:
        torch.cuda.synchronize()
        r = {"case": "idle"}
        r.update(measure(nv, lambda: time.sleep(0.05), args.secs, warm_secs=0.5))
        rows.append(r)
        print(json.dumps(r), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"head": head, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
