"""Measure which tile entry of each Triton kernel wins on this GPU, and write `longctx.tuning.MEASURED_TILES`.

The launchers never autotune at run time (every new length bucket would stall on compiling and timing candidates);
they take the entry this script measured. Run it once per GPU model:

    PYTHONPATH=src python dev/tune_tiles.py --out $OUT/tiles.json            # on the GPU (about 5 minutes on an H100)
    python dev/tune_tiles.py --write $OUT/tiles.json                         # anywhere: into src/longctx/tuning.py

Cases: dense kernels at D in {64, 128, 256}, bands full and causal (a window takes the causal rows), S in {1K, 2K,
4K, 16K} with batch x S = 16K tokens and heads x D = 2048 (the FlashAttention benchmark shapes), MHA, plus GQA 4:1
at D=128; block-sparse kernels with a causal document mask (block 128) at D in {64, 128}. Each candidate is timed
with `triton.testing.do_bench` (median) with the warp-specialised kernels switched off, so the Triton kernel runs.
The JSON also holds every time measured, so a reader can see the margins.
"""

from __future__ import annotations

import argparse
import ast
import json
import pathlib
import re
import sys
import time

BEGIN = "    # BEGIN MEASURED TILES (written by dev/tune_tiles.py)\n"
END = "    # END MEASURED TILES\n"
GPUS_BEGIN = "    # BEGIN MEASURED GPUS (written by dev/tune_tiles.py)\n"
GPUS_END = "    # END MEASURED GPUS\n"


def _bench(fn) -> float:
    import triton

    return float(triton.testing.do_bench(fn, warmup=5, rep=25))


def _pick(key: str, overrides: list[dict], fwd, bwd_fn, kind: str, rows: dict, times: dict) -> None:
    """Time the forward ``fwd`` (kind "fwd") or the backward ``bwd_fn()`` returns, under each candidate's tuning
    overrides; record every time (or the error of a candidate that does not fit, e.g. in shared memory) under
    ``key#index`` and the fastest index under ``key``."""
    from longctx import tuning

    best = None
    for i, ov in enumerate(overrides):
        try:
            with tuning.override(**ov):
                t = _bench(fwd) if kind == "fwd" else _bench(bwd_fn())
        except Exception as exc:  # a candidate that does not fit this variant's shared memory
            times[f"{key}#{i}"] = f"{type(exc).__name__}"
            continue
        times[f"{key}#{i}"] = round(t, 4)
        if best is None or t < best[0]:
            best = (t, i)
    if best is not None:
        rows[key] = best[1]
    print(f"{key}: entry {rows.get(key)}", file=sys.stderr, flush=True)


def _dense_cases(head_dims, lengths):
    for d in head_dims:
        for causal in (False, True):
            for s in lengths:
                yield d, causal, s, 2048 // d, 2048 // d
    for causal in (False, True):
        for s in lengths if 128 in head_dims else ():
            yield 128, causal, s, 16, 4


def _time_dense(d, causal, s, hq, hkv, rows, times, deadline):
    import torch

    from longctx import tuning
    from longctx.api import attention

    b = max(1, 16384 // s)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, hq, s, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    k = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    v = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    do = torch.randn_like(q)
    bd = tuning.block_d(d)
    band = "causal" if causal else "full"
    bucket = tuning.seq_bucket(s)
    grouped = hq != hkv

    def fwd():
        return attention(q, k, v, causal=causal, backend="triton")

    def bwd_fn():
        out = fwd()
        return lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)

    dkdv = [("dv", False), ("dk", False)] if tuning.split_dkdv(bd) else [("dkdv", False)]
    kinds = [("fwd", None), *dkdv, ("dq", False)] + ([("dkdv_atomic", True)] if bd <= 128 else [])
    for kind, atomic in kinds:
        if time.monotonic() > deadline:
            return
        key = tuning.tile_key(kind, bd, band, bucket, grouped)
        overrides = []
        for entry in tuning.table(kind)[bd]:
            forced = {kind: entry}
            # the other backward kernels take the entries measured before them (timed as one backward)
            for other, _ in dkdv:
                if other != kind and kind != "fwd":
                    index = rows.get(tuning.tile_key(other, bd, band, bucket, grouped), 0)
                    forced[other] = tuning.table(other)[bd][index]
            ov = dict(ws=False, ws_bwd=False, tiles=forced)
            if atomic is not None:
                ov["atomic_dq"] = atomic
            overrides.append(ov)
        _pick(key, overrides, fwd, bwd_fn, kind, rows, times)


def _time_sparse(d, s, rows, times, deadline):
    import torch

    from longctx import tuning
    from longctx.api import attention
    from longctx.masks import block_mask, causal_mask, document_mask

    h = 2048 // d
    g = torch.Generator(device="cuda").manual_seed(0)
    lens = torch.randint(512, 8192, (64,), generator=torch.Generator().manual_seed(1))
    doc = torch.repeat_interleave(torch.arange(64), lens)[:s]
    doc = torch.cat([doc, doc.new_full((s - doc.numel(),), 64)]).cuda()
    mask = block_mask(document_mask(doc) & causal_mask, None, None, s, s, device="cuda")
    q, k, v = (
        torch.randn(1, h, s, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_() for _ in range(3)
    )
    do = torch.randn_like(q)
    bd = tuning.block_d(d)
    bucket = tuning.seq_bucket(s)

    def fwd():
        return attention(q, k, v, block_mask=mask, backend="triton_sparse")

    def bwd_fn():
        out = fwd()
        return lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)

    for kind in ("fwd", "dkdv", "dq"):
        if time.monotonic() > deadline:
            return
        choices = tuning.sparse_tile_choices(kind, bd, 128)
        key = tuning.sparse_tile_key(kind, bd, 128, bucket)
        overrides = [dict(sparse_ws=False, sparse_ws_bwd=False, sparse_tiles={kind: entry}) for entry in choices]
        _pick(key, overrides, fwd, bwd_fn, kind, rows, times)


def measure(out: pathlib.Path, budget_s: float, head_dims: tuple[int, ...], lengths: tuple[int, ...]) -> None:
    import torch

    deadline = time.monotonic() + budget_s
    rows: dict[str, int] = {}
    times: dict[str, object] = {}
    for case in _dense_cases(head_dims, lengths):
        _time_dense(*case, rows, times, deadline)
    for d in (64, 128):
        for s in (4096, 16384, 65536) if d in head_dims else ():
            _time_sparse(d, s, rows, times, deadline)
    gpu = torch.cuda.get_device_name()
    p = torch.cuda.get_device_properties(0)
    facts = [list(torch.cuda.get_device_capability()), p.multi_processor_count, round(p.total_memory / 2**30)]
    data = {"gpu": gpu, "facts": facts, "head_dims": list(head_dims), "rows": rows, "times_ms": times}
    out.write_text(json.dumps(data, indent=1))
    print(f"{len(rows)} rows for {gpu} -> {out}", file=sys.stderr)


def write(path: pathlib.Path, tuning_py: pathlib.Path) -> None:
    """Put the measured rows of ``path`` into `MEASURED_TILES`: that GPU's previous rows at the head dims the file
    measured are replaced, its rows at other head dims kept."""
    data = json.loads(path.read_text())
    src = tuning_py.read_text()
    i, j = src.index(BEGIN) + len(BEGIN), src.index(END)
    block = src[i:j]
    gpu = data["gpu"]
    measured = {str(d) for d in data.get("head_dims", (64, 128, 256))}
    previous = ast.literal_eval("{" + block + "}").get(gpu, {})
    kept = {k: v for k, v in previous.items() if k.split(":")[1] not in measured}
    rows = {**kept, **data["rows"]}
    # drop this GPU's previous block
    head = "    " + re.escape(json.dumps(gpu))
    block = re.sub(head + r": \{\n.*?\n    \},\n", "", block, flags=re.S)
    lines = [f"    {json.dumps(gpu)}: {{\n"]
    lines += [f"        {json.dumps(k)}: {v},\n" for k, v in sorted(rows.items())]
    lines.append("    },\n")
    src = src[:i] + block + "".join(lines) + src[j:]
    if "facts" in data:  # what tuning.tile_row compares a GPU without a row of its own against
        (major, minor), sms, gib = data["facts"]
        i, j = src.index(GPUS_BEGIN) + len(GPUS_BEGIN), src.index(GPUS_END)
        entry = f"    {json.dumps(gpu)}: (({major}, {minor}), {sms}, {gib}),\n"
        block = "".join(line for line in src[i:j].splitlines(True) if not line.startswith(f"    {json.dumps(gpu)}:"))
        src = src[:i] + block + entry + src[j:]
    tuning_py.write_text(src)
    print(f"{len(data['rows'])} measured rows ({len(kept)} kept) for {gpu} written to {tuning_py}")


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=pathlib.Path, help="measure on this GPU and write the rows and times here")
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop measuring after this many seconds")
    ap.add_argument("--write", type=pathlib.Path, help="a JSON written by --out: put its rows into tuning.py")
    ap.add_argument("--head-dims", default="64,128,256", help="measure only these head dims (comma-separated)")
    ap.add_argument("--lengths", default="1024,2048,4096,16384", help="dense cases' sequence lengths (comma-separated)")
    args = ap.parse_args()
    tuning_py = pathlib.Path(__file__).resolve().parents[1] / "src" / "longctx" / "tuning.py"
    if args.write:
        write(args.write, tuning_py)
    elif args.out:
        measure(args.out, args.budget_s, _ints(args.head_dims), _ints(args.lengths))
    else:
        ap.error("give --out (measure) or --write (update tuning.py)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
