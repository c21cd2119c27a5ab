"""Compile the default block-sparse kernels of a source tree for sm_90a (no GPU needed) and print a hash of each
kernel's SASS, so that two trees can be compared after a refactor that should not change the compiled code.

    python dev/sass_diff_sparse.py /path/to/tree [--dump DIR]

Compiled: the Triton kernels (`kernels/triton/flash_sparse.py`: forward with tensor-descriptor and with pointer
loads, dK/dV, dQ) and the warp-specialised Gluon kernels (`kernels/gluon/flash_sparse_ws.py`: persistent forward
and backward), at D=64 and 128, for the mask kinds 0 (block layout), 1 (analytic document band), 2 (stored tiles)
and 3 (analytic, interval form), with the launchers' default tiles and variants. Constexprs a tree's kernel does
not declare are dropped, so the same list serves a tree before and after a variant's removal.

Two hashes per kernel: ``exact`` (the SASS text without addresses and encodings) and ``params`` (also without the
constant-bank offsets of the kernel parameters: removing an unused argument shifts those and nothing else).
``--dump DIR`` writes each normalised SASS listing there, for `diff`. Needs a Triton whose internals match
(written for 3.6, the GPU machine's): run it with that Triton's Python.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
import tempfile

# tiles of the default launch (first table entries, mask block 128): kind -> D -> (BLOCK_M, BLOCK_N, warps, stages)
TRITON_TILES = {
    "fwd": {64: (128, 64, 4, 3), 128: (128, 64, 8, 3)},
    "dkdv": {64: (64, 128, 8, 3), 128: (64, 128, 8, 3)},
    "dq": {64: (128, 128, 8, 3), 128: (128, 64, 8, 3)},
}
# the Gluon kernels' configs: forward (BLOCK_N, STAGES, PIPE), backward (BLOCK_M, STAGES, EARLY_DV)
WS_FWD = {64: (128, 3, True), 128: (128, 3, True)}
WS_BWD = {64: (64, 2, False), 128: (64, 2, False)}
# mask kind -> (HAS_DOC, HAS_GLOBAL, even lengths)
MASKS = {0: (False, False, True), 1: (True, False, True), 2: (False, False, False), 3: (True, False, False)}
# the launchers' default variants, for a tree whose kernels still declare them
LEGACY_DEFAULTS = dict(GRID_SWAP=True, PREFETCH_IDX=True, PIPE_QK=False, REVERSE_M=False, ATOMIC_DQ=0,
                       PERSIST=True, USE_SCHED=True, EARLY_Q=False, O_TMA=True, O_STAGE=False, TRACE=False,
                       DQ_TMA=True)  # fmt: skip

POINTERS = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "DO": "*bf16", "DQ": "*bf16", "DK": "*bf16",
            "DV": "*bf16", "LSE": "*fp32", "LSE2": "*fp32", "DELTA": "*fp32", "DQA": "*fp32", "TILES": "*i1",
            "TR": "*i64", "qk_scale": "fp32", "sm_scale": "fp32"}  # fmt: skip
POINTERS.update({n: "*i32" for n in ("KV_NUM", "KV_IDX", "Q_NUM", "Q_IDX", "FULL_NUM", "FULL_IDX", "QDOC", "KDOC",
                                     "QPOS", "KPOS", "TILE_IDS", "SCHED", "CNT")})  # fmt: skip


def _normalise(sass: str, params: bool) -> str:
    out = []
    for line in sass.splitlines():
        line = re.sub(r"/\*[0-9a-f]{4,}\*/", "", line)  # addresses
        line = re.sub(r"/\* 0x[0-9a-f]+ \*/", "", line)  # encodings
        if params:
            line = re.sub(r"c\[0x0\]\[0x[0-9a-f]+\]", "c[0x0][P]", line)
        line = line.strip()
        if line and not line.startswith(("code for", "Fatbin", "arch =", "host =", "compile_size", ".")):
            out.append(line)
    return "\n".join(out) + "\n"


def _sass(cubin: bytes, tool: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tree", help="a source tree holding src/longctx")
    ap.add_argument("--dump", help="write each normalised SASS listing into this folder")
    args = ap.parse_args()
    sys.path.insert(0, os.path.join(os.path.abspath(args.tree), "src"))

    import torch
    import triton
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource

    from longctx.kernels.gluon import flash_sparse_ws as sws
    from longctx.kernels.triton import flash_sparse as fs
    from longctx.launchers import flash as tf
    from longctx.launchers import runtime

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    target = GPUTarget("cuda", 90, 32)

    def compile_(fn, consts: dict, descs: dict, options: dict, gluon: bool):
        consts = {k: v for k, v in {**LEGACY_DEFAULTS, **consts}.items() if k in fn.arg_names}
        sig, attrs = {}, {}
        for i, name in enumerate(fn.arg_names):
            if name in consts:
                sig[name] = "constexpr"
            elif name in descs:
                sig[name] = native_specialize_impl(BaseBackend, descs[name], False, True, True)[0]
            else:
                sig[name] = POINTERS.get(name, "i32")
                if sig[name].startswith("*"):
                    attrs[(i,)] = [["tt.divisibility", 16]]
        src = (GluonASTSource if gluon else ASTSource)(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
        return triton.compile(src, target=target, options=options)

    def report(name: str, k) -> None:
        sass = _sass(k.asm["cubin"], tool)
        exact, params = _normalise(sass, False), _normalise(sass, True)
        h = [hashlib.sha256(s.encode()).hexdigest()[:16] for s in (exact, params)]
        print(f"{name:44s} exact {h[0]}  params {h[1]}  ({exact.count(chr(10))} lines)", flush=True)
        if args.dump:
            os.makedirs(args.dump, exist_ok=True)
            with open(os.path.join(args.dump, name + ".sass"), "w") as f:
                f.write(exact)

    for D in (64, 128):
        t = torch.empty(1, 1, 256, D, dtype=torch.bfloat16)
        for kind, (has_doc, has_global, even) in MASKS.items():
            mask = dict(MASK_BS=128, MASK_KIND=kind, HAS_DOC=has_doc, HAS_GLOBAL=has_global)
            common = dict(HEAD_DIM=D, BLOCK_D=D, DOT_PRECISION="ieee", **mask)
            for kname, fn in (("fwd", fs.sparse_fwd_kernel), ("dkdv", fs.sparse_bwd_dkdv_kernel),
                              ("dq", fs.sparse_bwd_dq_kernel)):  # fmt: skip
                bm, bn, w, s = TRITON_TILES[kname][D]
                consts = dict(common, BLOCK_M=bm, BLOCK_N=bn, EVEN_SK=even)
                for tma in (True, False) if kname == "fwd" else (False,):
                    k = compile_(fn, dict(consts, USE_TMA=tma), {}, {"num_warps": w, "num_stages": s}, False)
                    report(f"triton_{kname}{'_tma' if tma else ''}_D{D}_kind{kind}", k)

            # the warp-specialised kernels (persistent)
            block_n, stages, pipe = WS_FWD[D]
            consts = dict(HEAD_DIM=D, BLOCK_D=D, EVEN_SK=even, BLOCK_N=block_n, STAGES=stages, PIPE=pipe,
                          V_STAGES=stages, CONSUMER_REGS=240, PRODUCER_REGS=24, **mask)  # fmt: skip
            descs = {
                "desc_q": runtime._gluon_desc(t, int(sws.WG_ROWS)),
                "desc_k": runtime._gluon_desc(t, block_n),
                "desc_v": runtime._gluon_desc(t, block_n),
                "desc_o": runtime._gluon_desc(t, int(sws.WG_ROWS)),
            }
            opts = {"num_warps": 4, "maxnreg": 168}
            report(f"gluon_fwd_D{D}_kind{kind}", compile_(sws.sparse_fwd_ws_kernel, consts, descs, opts, True))
            block_m, stages, early_dv = WS_BWD[D]
            rows_desc = runtime._gluon_rows_desc(torch.empty(1, 1, 256, dtype=torch.float32), block_m)
            dqa = tf._dqa_desc(torch.empty(1, 1, 256, D, dtype=torch.float32), block_m, D)
            consts = dict(BLOCK_D=D, EVEN=even, BLOCK_M=block_m, STAGES=stages, EARLY_DV=early_dv,
                          CONSUMER_REGS=240, PRODUCER_REGS=24, **mask)  # fmt: skip
            descs = {"desc_q": runtime._gluon_desc(t, block_m), "desc_k": runtime._gluon_desc(t, 128),
                     "desc_v": runtime._gluon_desc(t, 128), "desc_do": runtime._gluon_desc(t, block_m),
                     "desc_lse2": rows_desc, "desc_delta": rows_desc, "desc_dqa": dqa,
                     "desc_dk": runtime._gluon_desc(t, int(sws.WG_ROWS)),
                     "desc_dv": runtime._gluon_desc(t, int(sws.WG_ROWS))}  # fmt: skip
            report(f"gluon_bwd_D{D}_kind{kind}", compile_(sws.sparse_bwd_ws_kernel, consts, descs, opts, True))


if __name__ == "__main__":
    main()
