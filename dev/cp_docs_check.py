"""Packed documents under context parallelism on GPUs (torchrun, NCCL): every method in bf16 against a float64
oracle, next to one GPU's `flash_attn_varlen_func` on the whole packed sequence; and, on rank 0, the block-sparse
backward with float32 against bf16 gradients (time and error).

    torchrun --nproc-per-node 4 dev/cp_docs_check.py --out DIR

A row passes when every error (out, dq, dk, dv; max-abs against the oracle) is at most twice the one-GPU kernel's
plus 1e-3. Writes DIR/cp_docs_check.json and prints one line per row.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist


def _mix(total: int, world: int, kind: str, seed: int) -> list[int]:
    from longctx.masks import doc_lengths

    n = total // world
    cap, median = (n, max(1, n // 16)) if kind == "short" else (total, n)
    lengths = doc_lengths(total, seed=seed, cap=cap, median=median)
    cu = [0]
    for L in lengths:
        cu.append(cu[-1] + L)
    return cu


def _oracle(q, k, v, do, cu, causal):
    """float64 per-document dense attention: (out, dq, dk, dv), packed (total, H, D)."""
    from longctx.masks import Band
    from longctx.reference.naive import naive_attention

    outs, dqs, dks, dvs = [], [], [], []
    for a, b in zip(cu, cu[1:]):
        if b == a:
            continue
        qd, kd, vd = (t[a:b].permute(1, 0, 2)[None].double().requires_grad_() for t in (q, k, v))
        o, _ = naive_attention(qd, kd, vd, scale=q.shape[-1] ** -0.5, band=Band.from_args(b - a, b - a, causal))
        o.backward(do[a:b].permute(1, 0, 2)[None].double())
        outs.append(o.detach()[0].permute(1, 0, 2))
        for acc, t in ((dqs, qd), (dks, kd), (dvs, vd)):
            acc.append(t.grad[0].permute(1, 0, 2))
    return [torch.cat(x) for x in (outs, dqs, dks, dvs)]


def check(args, rank: int, world: int, dev: torch.device) -> list[dict]:
    import longctx
    from longctx.distributed import dispatch_plan

    rows = []
    Hq, Hkv, D, total = 8, 2, 128, args.total
    for kind in ("short", "long"):
        cu = _mix(total, world, kind, seed=1)
        for causal in (True, False):
            g = torch.Generator(device=dev).manual_seed(99)
            q, k, v, do = (torch.randn(total, h, D, generator=g, device=dev) for h in (Hq, Hkv, Hkv, Hq))
            oracle = _oracle(q, k, v, do, cu, causal)
            cut = torch.tensor(cu, dtype=torch.int32, device=dev)
            mx = max(b - a for a, b in zip(cu, cu[1:]))
            one = [t.bfloat16().requires_grad_() for t in (q, k, v)]
            o1 = longctx.flash_attn_varlen_func(*one, cut, cut, mx, mx, causal=causal)
            o1.backward(do.bfloat16())
            single = [o1.detach()] + [t.grad for t in one]
            plan = dispatch_plan(cu, causal=causal)
            for method in ("ring", "allgather", "ulysses", "ulysses_ring", "p2p"):
                extra = {"ulysses_size": 2} if method == "ulysses_ring" else {}
                loc = [plan.dispatch(t.bfloat16()).detach().requires_grad_() for t in (q, k, v)]
                out = plan.attention(*loc, method=method, **extra)
                out.backward(plan.dispatch(do.bfloat16()))
                got = [out.detach()] + [t.grad for t in loc]
                row = dict(mix=kind, causal=causal, method=method, documents=len(cu) - 1, longest=mx,
                           balance=plan.balance(), ok=True)  # fmt: skip
                for name, a, s1, o in zip(("out", "dq", "dk", "dv"), got, single, oracle):
                    o_loc = plan.dispatch(o)
                    e = torch.tensor([float((a.double() - o_loc).abs().max()),
                                      float((plan.dispatch(s1).double() - o_loc).abs().max())], device=dev)  # fmt: skip
                    dist.all_reduce(e, op=dist.ReduceOp.MAX)
                    row[f"err_{name}"], row[f"err1_{name}"] = e.tolist()
                    row["ok"] &= row[f"err_{name}"] <= 2 * row[f"err1_{name}"] + 1e-3
                rows.append(row)
                if rank == 0:
                    errs = " ".join(f"{n} {row['err_' + n]:.1e}/{row['err1_' + n]:.1e}" for n in ("out", "dq", "dk"))
                    verdict = "PASS" if row["ok"] else "FAIL"
                    print(f"check {kind:5s} causal={causal!s:5s} {method:12s} {errs} {verdict}", flush=True)
    return rows


def grad_dtypes(dev: torch.device) -> dict:
    """The block-sparse backward at 16K packed tokens (16 / 4 heads, D=128): float32 gradients (what context
    parallelism asks for) against bf16 ones, time and error against float64."""
    import triton.testing

    from longctx.launchers.sparse import sparse_backward, sparse_forward
    from longctx.masks import block_mask, causal_mask, document_mask

    S, Hq, Hkv, D = 16384, 16, 4, 128
    cu = _mix(S, 4, "short", seed=3)
    ids = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.tensor([b - a for a, b in zip(cu, cu[1:])]))
    bm = block_mask(document_mask(ids.to(dev)) & causal_mask, None, None, S, S, device=dev)
    g = torch.Generator(device=dev).manual_seed(5)
    q, k, v, do = (torch.randn(1, h, S, D, generator=g, device=dev, dtype=torch.bfloat16) for h in (Hq, Hkv, Hkv, Hq))
    out, lse = sparse_forward(q, k, v, scale=D**-0.5, block_mask=bm)
    res = {}
    grads = {}
    for name, gd in (("bf16", None), ("fp32", torch.float32)):
        fn = lambda gd=gd: sparse_backward(do, q, k, v, out, lse, scale=D**-0.5, block_mask=bm, grad_dtype=gd)  # noqa: E731
        grads[name] = fn()
        res[f"{name}_ms"] = triton.testing.do_bench(fn, warmup=25, rep=100)
    for i, n in enumerate(("dq", "dk", "dv")):
        res[f"max_diff_{n}"] = float((grads["fp32"][i].double() - grads["bf16"][i].double()).abs().max())
        res[f"max_{n}"] = float(grads["fp32"][i].double().abs().max())
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="cp_docs_out")
    ap.add_argument("--total", type=int, default=8192)
    args = ap.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(dev)
    t0 = time.time()
    result = {"gpu": torch.cuda.get_device_name(), "world": world, "torch": torch.__version__}
    result["check"] = check(args, rank, world, dev)
    if rank == 0:
        result["grad_dtypes"] = grad_dtypes(dev)
        print("grad dtypes", json.dumps(result["grad_dtypes"]), flush=True)
        result["seconds"] = time.time() - t0
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "cp_docs_check.json"), "w") as f:
            json.dump(result, f, indent=1)
        bad = [r for r in result["check"] if not r["ok"]]
        print(f"{len(result['check']) - len(bad)} passed, {len(bad)} failed in {time.time() - t0:.0f} s", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
