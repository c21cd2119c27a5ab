"""What an offloaded step holds on the GPU at its peak, by allocation site, against the memory model's items.

One llama-8b step with its states in host memory (`offload_model`, ``--resident`` units kept on the GPU) under
``torch.cuda.memory._record_memory_history``: the recorded allocations and frees are replayed to the moment the live
bytes peak, and the blocks live then are summed by where they were allocated (the innermost frame in longctx or in
torch's FSDP2, with its line). Beside it, `longctx.memory.model.step_memory`'s prediction and its items. For finding
which of the model's terms FSDP2 does not hold (or holds beyond the model).

    PYTHONPATH=src python dev/offload_peak.py --seq-length 8192 --resident 17 --out peak.json
"""

from __future__ import annotations

import argparse
import collections
import json

import torch


def _site(frames: list[dict]) -> str:
    """The innermost frame of longctx or of torch's FSDP2 / autograd in an allocation's Python stack."""
    for f in frames:
        name = f.get("filename", "")
        if "longctx" in name or "fsdp" in name or "optim" in name:
            short = name.split("site-packages/")[-1].split("src/")[-1]
            return f"{short}:{f.get('line')} {f.get('name')}"
    return "other"


def replay(trace: list[dict], base: int) -> tuple[int, dict[str, int], int]:
    """(peak live bytes, live bytes at the peak by allocation site, index of the peak event): allocations counted
    until their free is requested (the caching allocator's allocated-bytes statistic)."""
    live: dict[int, tuple[int, str]] = {}
    cur = peak = base
    at = -1
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], None)
            cur += e["size"]
            if cur > peak:
                peak, at = cur, i
        elif e["action"] == "free_requested" and e["addr"] in live:
            cur -= live.pop(e["addr"])[0]
    # the blocks live at the peak: a second pass to that event
    live2: dict[int, tuple[int, int]] = {}
    for i, e in enumerate(trace[: at + 1]):
        if e["action"] == "alloc":
            live2[e["addr"]] = (e["size"], i)
        elif e["action"] == "free_requested":
            live2.pop(e["addr"], None)
    sites: dict[str, int] = collections.Counter()
    for size, i in live2.values():
        sites[_site(trace[i].get("frames", []))] += size
    return peak, dict(sites), at


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-length", type=int, default=8192)
    ap.add_argument("--resident", type=int, default=17)
    ap.add_argument("--preset", default="llama-8b")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from longctx.distributed.offload import build_device, host_adamw, offload_model
    from longctx.memory.model import step_memory
    from longctx.memory.plan import parameter_count
    from longctx.models.gpt import GPT, GPTConfig

    S, dev = args.seq_length, torch.device("cuda")
    cfg = GPTConfig.preset(args.preset).replace(
        seq_length=S, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
        recompute_skip_core_attention=True,
    )  # fmt: skip
    torch.manual_seed(0)
    with build_device(parameter_count(cfg)[1], dev):
        model = GPT(cfg)
    offload_model(model, resident_units=args.resident)
    opt = host_adamw(model, lr=1e-5, max_grad_norm=1.0)
    x = torch.randint(0, cfg.vocab_size, (1, S), device=dev)

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, labels=x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # AdamW's states exist from here on
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=4_000_000, stacks="python")
    step()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    measured = torch.cuda.max_memory_allocated()
    trace = snap["device_traces"][dev.index or 0]
    peak, sites, at = replay(trace, base)
    pred = step_memory(cfg, seq_length=S, offload_params=True, resident_units=args.resident)
    out = {
        "gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__, "preset": args.preset, "seq_length": S,
        "resident_units": args.resident, "measured_peak": measured, "replayed_peak": peak, "base": base,
        "events": len(trace), "peak_event": at, "predicted": pred.total,
        "predicted_rows": {name: b for name, b in pred.rows()},
        "live_at_peak_by_site": dict(sorted(sites.items(), key=lambda kv: -kv[1])),
    }  # fmt: skip
    gib = 2**30
    print(f"measured {measured / gib:.2f} GiB, replayed {peak / gib:.2f}, base {base / gib:.2f}, "
          f"predicted {pred.total / gib:.2f} ({pred.total / measured:.3f})")  # fmt: skip
    for name, b in pred.rows():
        print(f"  predicted  {b / gib:8.2f}  {name}")
    for site, b in list(out["live_at_peak_by_site"].items())[:40]:
        print(f"  at peak    {b / gib:8.3f}  {site}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
