"""`longctx bench suite --cp --cp-check`: NCCL bf16 correctness of context-parallel attention against a float64
oracle, next to the single-GPU kernel on the whole sequence, and its Markdown section (`markdown`)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from longctx.bench.suite.ranks import empty_cache, log, max_over_ranks


def run_check(args, launcher: str) -> list[dict]:
    """Every method and layout of `cp_attention` in bf16 against a float64 oracle, next to the single-GPU
    kernel on the whole sequence (see the package docstring); one row per mask, method and layout."""
    import longctx
    from longctx.distributed import cp_attention, shard

    dev = torch.device(args.device)
    P = dist.get_world_size()
    S, B, Hq, Hkv, D = args.check_seqlen, 1, args.heads, args.kv_heads, args.head_dim
    rows = []
    masks = [("causal", True, None), ("full", False, None), ("causal-window", True, (S // 4 - 1, 0))]
    for mask_name, causal, window in masks:
        g = torch.Generator(device=dev).manual_seed(1234)  # the same full inputs on every rank
        q, k, v, do = (
            torch.randn(B, h, S, D, generator=g, device=dev, dtype=torch.float64) for h in (Hq, Hkv, Hkv, Hq)
        )
        # float64 oracle and the single-GPU bf16 kernel, both on the whole sequence
        ref = [t.clone().requires_grad_() for t in (q, k, v)]
        o_ref = longctx.attention(*ref, causal=causal, window=window, backend="math")
        o_ref.backward(do)
        oracle = [o_ref.detach()] + [t.grad for t in ref]
        del ref, o_ref
        one = [t.bfloat16().requires_grad_() for t in (q, k, v)]
        o_one = longctx.attention(*one, causal=causal, window=window, backend=launcher)
        o_one.backward(do.bfloat16())
        single = [o_one.detach()] + [t.grad for t in one]
        del one, o_one
        for method in args.methods:
            for layout in args.layouts:
                loc = [shard(t.bfloat16(), 2, layout=layout).requires_grad_() for t in (q, k, v)]
                out = cp_attention(
                    *loc, causal=causal, window=window, method=method, layout=layout, backend=args.backend
                )
                out.backward(shard(do.bfloat16(), 2, layout=layout))
                cp = [out.detach()] + [t.grad for t in loc]
                row = dict(mask=mask_name, method=method, layout=layout, S=S, P=P, ok=True)
                for name, a, s1, o in zip(("out", "dq", "dk", "dv"), cp, single, oracle):
                    o_loc = shard(o, 2, layout=layout)
                    e_cp = max_over_ranks(float((a.double() - o_loc).abs().max()), dev)
                    e_1 = max_over_ranks(float((shard(s1, 2, layout=layout).double() - o_loc).abs().max()), dev)
                    row[f"err_{name}"], row[f"err1_{name}"] = e_cp, e_1
                    row["ok"] &= e_cp <= 2 * e_1 + 1e-5
                rows.append(row)
                log(
                    f"check {mask_name:13s} {method:9s} {layout:10s} "
                    + " ".join(f"{n} {row['err_' + n]:.2e}/{row['err1_' + n]:.2e}" for n in ("out", "dq", "dk", "dv"))
                    + ("  PASS" if row["ok"] else "  FAIL")
                )
        del q, k, v, do, oracle, single
        empty_cache(dev)
    return rows


def markdown(rows: list[dict], args) -> str:
    """The Markdown section of the check's rows."""
    lines = [
        f"## NCCL correctness (bf16, S={rows[0]['S']}, Hq={args.heads}, Hkv={args.kv_heads}, D={args.head_dim})",
        "",
        "max |error| against the float64 oracle: context parallel / single-GPU kernel on the whole sequence. "
        "Pass: cp <= 2 x single + 1e-5.",
        "",
        "| mask | method | layout | out | dq | dk | dv | pass |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = " | ".join(f"{r['err_' + n]:.1e} / {r['err1_' + n]:.1e}" for n in ("out", "dq", "dk", "dv"))
        lines.append(f"| {r['mask']} | {r['method']} | {r['layout']} | {cells} | {'yes' if r['ok'] else 'NO'} |")
    return "\n".join(lines) + "\n"
