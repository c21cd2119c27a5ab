"""Session 11's check of the warp-specialised sparse forward's shared-memory variants: each (output tiles of its
own, V ring slots, unused) triple in VARS (default "130,120": staged output with 3 / 2 V slots) against the
default launch (0, 3, 0), on causal and a 30% random layout, head dims DS, the first NS of (S=1024: one item per
CTA, S=4096: several). Prints the largest difference and where the wrong rows are. (Session 11's first version,
call e1, indexed two Q buffer sets at run time; this script showed its masked runs going wrong.)"""
import os
import sys

import torch

sys.path.insert(0, "src")
import longctx  # noqa: E402
import longctx.masks as bsm  # noqa: E402
from longctx.launchers import sparse as ts  # noqa: E402

torch.manual_seed(0)
for D in [int(x) for x in os.environ.get('DS', '64,128').split(',')]:
    for S, B, H in ((1024, 2, 8), (4096, 1, 16))[: int(os.environ.get('NS', '2'))]:
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for mname, bm in (("causal", longctx.block_mask(bsm.causal_mask, None, None, S, S, device="cuda")),
                          ("layout", longctx.BlockMask.from_layout((torch.rand(H, S // 128, S // 128) < 0.3).cuda(), 128, S, S))):
            res = {}
            for qb, vs, dbg in [(0, 3, 0)] + [tuple(int(c) for c in x) for x in os.environ.get('VARS', '130,120').split(',')]:
                ts._o_stage = lambda *a, qb=qb, vs=vs: (bool(qb), vs)
                try:
                    out, lse = ts.sparse_forward(q, k, v, scale=D**-0.5, block_mask=bm)
                    torch.cuda.synchronize()
                except Exception as exc:
                    print(D, S, mname, (qb, vs, dbg), "ERROR", str(exc)[:200], flush=True)
                    sys.exit(1)
                if not res:
                    res["ref"] = (out.float(), lse)
                    continue
                err = (out.float() - res["ref"][0]).abs()
                bad = err.amax(-1) > 0.05  # (B, H, S)
                rows = bad.nonzero()
                info = ""
                if len(rows):
                    r = rows[:, 2]
                    info = (f"bad rows {len(rows)}; row%128<64: {(r % 128 < 64).sum().item()}; "
                            f"first {rows[:4].tolist()}; cols bad (first row) "
                            f"{(err[tuple(rows[0])] > 0.05).nonzero().flatten()[:8].tolist()}")
                lerr = (lse - res["ref"][1]).abs().nan_to_num(0).max().item()
                print(D, S, mname, (qb, vs, dbg), f"max {err.max().item():.3e} lse {lerr:.2e}", info, flush=True)
