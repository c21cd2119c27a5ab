"""Fingerprint the SASS of the dense kernels' default variants, compiled offline for an H100 (sm_90a).

Run it on two source trees and compare the lines: a refactor that keeps every hash kept every compiled kernel.

    python dev/sass_diff.py /tmp/base > base.txt
    python dev/sass_diff.py . > new.txt
    diff base.txt new.txt

Triton compiles for a GPU target without a GPU and ships cuobjdump, so this runs on any machine with the Triton
the GPU machine uses (the SASS of another Triton version differs). Each line: the case, the SHA-256 (first 16 hex
digits) of the SASS with addresses and encodings stripped, the instruction count and the shared memory in bytes;
with ``--regs`` also the registers per thread and the stack frame (`cuobjdump -res-usage`) and the number of local
memory instructions (STL / LDL: register spills) in the SASS.

The cases are the variants the launchers take by default (`longctx.launchers.flash`), each kernel with the first
(non-autotuned) tile of `longctx.tuning`'s lists: the Triton forward at D = 64 / 128 / 256, causal and dense, with
K/V through host descriptors (the default), per-program descriptors (broadcast views) and pointer loads (unaligned
views); the dK/dV kernel with dQ by atomics (TMA reduce at D = 128) and without (the deterministic path); the dQ
kernel; at D = 256 the dV-only and dK-only launches of the dK/dV kernel and the dQ kernel; the Gluon forward and
backward at D = 64 / 128, causal and dense; the same Gluon kernels with the logit softcap (SOFTCAP), then the
block-sparse Gluon forward and backward (`flash_sparse_ws`, causal packed documents) at D = 64 / 128, without and
with the softcap. Both source layouts are understood (kernels in `longctx/kernels/` or in
`longctx/kernels/{triton,gluon}/`); kernel constexprs that a tree no longer has are dropped (so a tree without
SOFTCAP fingerprints its plain kernel under a softcap case's name), those it has and the case does not name take
their defaults.

Each kernel is compiled with the specialisation a launch on contiguous tensors gets, so that the instructions,
registers and spills are those that run: the head-dim strides are the constant 1, pointers and the other strides
16-divisible, except the arguments the kernel does not specialise (``do_not_specialize``: lengths, window bounds,
mask-table strides). Without it Triton would, for instance, not see the unit stride and load the backward's Q and
dO tiles one element at a time into registers instead of copying them asynchronously to shared memory.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import os
import re
import subprocess
import sys
import tempfile

# the first entry of each tile list (`longctx.tuning`), fixed here so that both trees compile the same tiles
FWD_TILE = {64: (128, 64, 4, 3, False), 128: (128, 64, 8, 3, True), 256: (128, 64, 8, 2, False)}
# the head-dim strides: 1 in every launch on contiguous (or (B, S, H, D)-viewed) tensors, which Triton specialises
UNIT_STRIDES = {f"stride_{t}d" for t in ("q", "k", "v", "o", "do", "dk", "dv", "dq")}
DKDV_TILE = {64: (64, 128, 8, 3), 128: (64, 128, 8, 3)}
DQ_TILE = {64: (128, 128, 8, 3), 128: (128, 128, 8, 2), 256: (64, 64, 8, 2)}
SPLIT_TILE = {"dv": (64, 128, 8, 1), "dk": (32, 128, 8, 1)}
# the Gluon kernels' configs: forward (BLOCK_N, STAGES, PIPE), backward (BLOCK_M, STAGES, EARLY_DV)
WS_FWD = {64: (128, 3, True), 128: (128, 3, True)}
WS_FWD_SHORT_CAUSAL = {128: (128, 2, True)}
WS_BWD = {64: (64, 2, False), 128: (64, 2, False)}
# the block-sparse Gluon kernels' configs (`longctx.tuning.SPARSE_WS_FWD` / `SPARSE_WS_BWD`)
SPARSE_WS_FWD = {64: (128, 3, True), 128: (128, 3, True)}
SPARSE_WS_BWD = {64: (64, 2, False), 128: (64, 2, False)}


def _module(*names: str):
    for name in names:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError:
            continue
    raise ModuleNotFoundError(f"none of {names}")


def _cuobjdump(kernel, workdir: str, flag: str) -> str:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    path = os.path.join(workdir, "k.cubin")
    with open(path, "wb") as f:
        f.write(kernel.asm["cubin"])
    return subprocess.run([tool, flag, path], capture_output=True, text=True, check=True).stdout


def _regs(kernel, workdir: str, body: str) -> str:
    """``regs=R stack=S spill_ops=N``: registers per thread and stack frame bytes (cuobjdump -res-usage; R is the
    kernel's limit where warp specialisation resizes the partitions' register files) and the STL / LDL count."""
    usage = _cuobjdump(kernel, workdir, "-res-usage")
    reg = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    spills = len(re.findall(r"\b(?:STL|LDL)\b", body))
    return f"regs={reg.group(1) if reg else '?'} stack={stack.group(1) if stack else '?'} spill_ops={spills}"


def _sass(kernel, workdir: str) -> tuple[str, int, int, str]:
    text = _cuobjdump(kernel, workdir, "-sass")
    lines = []
    for line in text.splitlines():
        line = re.sub(r"/\*\s*[0-9a-fx]+\s*\*/", "", line)  # addresses and encodings
        line = line.strip().rstrip(";").strip()
        if line and not line.startswith(("Fatbin", "code for", "arch =", "code version", "host =", "compile_size")):
            lines.append(" ".join(line.split()))
    body = "\n".join(lines)
    n_instr = sum(1 for ln in lines if ln[0].isupper() or ln[0] == "@")
    return hashlib.sha256(body.encode()).hexdigest()[:16], n_instr, int(kernel.metadata.shared), body


def _compile(fn, consts: dict, types: dict, options: dict, gluon: bool = False):
    import triton
    from triton.backends.compiler import GPUTarget

    constexprs = {}
    sig = {}
    attrs = {}
    for i, p in enumerate(fn.params):
        name = p.name
        if p.is_constexpr:
            if name in consts:
                constexprs[name] = consts[name]
            elif p.has_default:
                constexprs[name] = p.default
            else:
                raise KeyError(f"{fn.__name__}: constexpr {name} has no value")
            sig[name] = "constexpr"
        elif name in UNIT_STRIDES and not p.do_not_specialize:
            constexprs[name] = 1  # a launch passes 1 for the head-dim stride of contiguous tensors
            sig[name] = "constexpr"
        else:
            sig[name] = types.get(name, "i32")
            if not p.do_not_specialize and (sig[name].startswith("*") or name.startswith("stride_")):
                attrs[(i,)] = [["tt.divisibility", 16]]
    if gluon:
        from triton.experimental.gluon._runtime import GluonASTSource as Source
    else:
        from triton.compiler import ASTSource as Source
    src = Source(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def _desc_type(desc) -> str:
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    return native_specialize_impl(BaseBackend, desc, False, True, True)[0]


def _gluon_desc(t, block):
    import torch
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    gdt = {torch.bfloat16: gl.bfloat16, torch.float32: gl.float32}[t.dtype]
    layout = gl.NVMMASharedLayout.get_default_for(list(block), gdt)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), list(block), layout)


def cases():
    """(name, thunk) per compiled kernel; the thunk returns the compiled kernel."""
    import torch

    ff = _module("longctx.kernels.triton.flash_fwd", "longctx.kernels.flash_fwd")
    fb = _module("longctx.kernels.triton.flash_bwd", "longctx.kernels.flash_bwd")
    common = {"qk_scale": "fp32", "sm_scale": "fp32"}
    ptrs = {n: "*bf16" for n in ("Q", "K", "V", "O", "DO", "DK", "DV", "DQ")}
    ptrs.update({n: "*fp32" for n in ("LSE", "LSE2", "DELTA", "DQA")})
    out = []
    for D in (64, 128, 256):
        bm, bn, w, s, pipe = FWD_TILE[D]
        for causal in (False, True):
            for load in ("host", "kernel", "pointer"):
                consts = dict(HEAD_DIM=D, BLOCK_D=D, HAS_LO=False, HAS_HI=causal, BLOCK_M=bm, BLOCK_N=bn,
                              LONGEST_FIRST=causal, DOT_PRECISION="tf32", USE_TMA=load != "pointer",
                              TMA_HOST=load == "host", PIPE_QK=pipe and load != "pointer")  # fmt: skip
                types = {**ptrs, **common, "DESC_K": "*bf16", "DESC_V": "*bf16"}
                if load == "host":
                    from triton.tools.tensor_descriptor import TensorDescriptor

                    t = torch.empty(1, 1, 256, D, dtype=torch.bfloat16)
                    desc = TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, bn, D])
                    types["DESC_K"] = types["DESC_V"] = _desc_type(desc)
                opts = {"num_warps": w, "num_stages": s}
                name = f"fwd D={D} {'causal' if causal else 'dense'} {load}"
                out.append((name, lambda c=consts, t=types, o=opts: _compile(ff.attn_fwd_kernel, c, t, o)))
    for D in (64, 128):
        for causal in (False, True):
            band = dict(HEAD_DIM=D, BLOCK_D=D, HAS_LO=False, HAS_HI=causal, DOT_PRECISION="tf32")
            types = {**ptrs, **common}
            bm, bn, w, s = DKDV_TILE[D]
            for atomic in (True, False):
                consts = dict(band, BLOCK_M=bm, BLOCK_N=bn, ATOMIC_DQ=atomic, USE_TMA=False, DQ_TMA=atomic and D == 128)
                opts = {"num_warps": w, "num_stages": s}
                name = f"dkdv D={D} {'causal' if causal else 'dense'} {'atomic' if atomic else 'separate'}"
                out.append((name, lambda c=consts, t=types, o=opts: _compile(fb.bwd_dkdv_kernel, c, t, o)))
            bm, bn, w, s = DQ_TILE[D]
            consts = dict(band, BLOCK_M=bm, BLOCK_N=bn, LONGEST_FIRST=causal)
            opts = {"num_warps": w, "num_stages": s}
            name = f"dq D={D} {'causal' if causal else 'dense'}"
            out.append((name, lambda c=consts, t=types, o=opts: _compile(fb.bwd_dq_kernel, c, t, o)))
    # D=256: dV and dK in two launches of the dK/dV kernel (`tuning.split_dkdv`), then the dQ kernel
    for causal in (False, True):
        band = dict(HEAD_DIM=256, BLOCK_D=256, HAS_LO=False, HAS_HI=causal, DOT_PRECISION="tf32")
        types = {**ptrs, **common}
        label = "causal" if causal else "dense"
        for kind, want in (("dv", dict(WANT_DK=False)), ("dk", dict(WANT_DV=False))):
            bm, bn, w, s = SPLIT_TILE[kind]
            consts = dict(band, BLOCK_M=bm, BLOCK_N=bn, **want)
            opts = {"num_warps": w, "num_stages": s}
            out.append(
                (f"{kind} D=256 {label}", lambda c=consts, t=types, o=opts: _compile(fb.bwd_dkdv_kernel, c, t, o))
            )
        bm, bn, w, s = DQ_TILE[256]
        consts = dict(band, BLOCK_M=bm, BLOCK_N=bn, LONGEST_FIRST=causal)
        opts = {"num_warps": w, "num_stages": s}
        out.append((f"dq D=256 {label}", lambda c=consts, t=types, o=opts: _compile(fb.bwd_dq_kernel, c, t, o)))
    consts = dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_M=64, HAS_DLSE=False)
    out.append(("bwd preprocess D=128", lambda c=consts: _compile(fb.bwd_preprocess_kernel, c, ptrs, {"num_warps": 4})))

    try:
        fws = _module("longctx.kernels.gluon.flash_fwd_ws", "longctx.kernels.flash_fwd_ws")
        bws = _module("longctx.kernels.gluon.flash_bwd_ws", "longctx.kernels.flash_bwd_ws")
    except ImportError as exc:  # a Triton without Gluon
        print(f"# Gluon kernels skipped: {exc}", file=sys.stderr)
        return out
    for D in (64, 128):
        configs = [("dense", False, WS_FWD[D]), ("causal", True, WS_FWD[D])]
        if D in WS_FWD_SHORT_CAUSAL:
            configs.append(("causal short", True, WS_FWD_SHORT_CAUSAL[D]))
        for label, causal, config in configs:
            out.append((f"gluon fwd D={D} {label}", _gluon_fwd(fws, D, causal, config, False)))
        for causal in (False, True):
            out.append((f"gluon bwd D={D} {'causal' if causal else 'dense'}", _gluon_bwd(bws, D, causal, False)))
    # the logit softcap (SOFTCAP) at the same configs; a tree without it compiles the plain kernel under these names
    for D in (64, 128):
        for causal in (False, True):
            label = "causal" if causal else "dense"
            out.append((f"gluon fwd D={D} {label} softcap", _gluon_fwd(fws, D, causal, WS_FWD[D], True)))
            out.append((f"gluon bwd D={D} {label} softcap", _gluon_bwd(bws, D, causal, True)))
    try:
        sws = _module("longctx.kernels.gluon.flash_sparse_ws")
    except ImportError as exc:  # a tree without the block-sparse Gluon kernels
        print(f"# block-sparse Gluon kernels skipped: {exc}", file=sys.stderr)
        return out
    for softcap in (False, True):
        for D in (64, 128):
            tail = " softcap" if softcap else ""
            out.append((f"gluon sparse fwd D={D} docs{tail}", _gluon_sparse_fwd(sws, D, softcap)))
            out.append((f"gluon sparse bwd D={D} docs{tail}", _gluon_sparse_bwd(sws, D, softcap)))
    return out


GOPTS = {"num_warps": 4, "maxnreg": 168}


def _gluon_fwd(fws, D: int, causal: bool, config, softcap: bool):
    """Thunk compiling `flash_fwd_ws.attn_fwd_ws_kernel` at head dim D with (BLOCK_N, STAGES, PIPE) ``config``."""
    import torch

    block_n, stages, pipe = config
    t = torch.empty(1, 1, 256, D, dtype=torch.bfloat16)
    consts = dict(HEAD_DIM=D, BLOCK_D=D, HAS_LO=False, HAS_HI=causal, LONGEST_FIRST=causal, BLOCK_N=block_n,
                  STAGES=stages, PIPE=pipe, CONSUMER_REGS=240, PRODUCER_REGS=24, SOFTCAP=softcap)  # fmt: skip
    types = {"O": "*bf16", "LSE": "*fp32", "qk_scale": "fp32", "softcap_scale": "fp32"}
    for name, rows in (("desc_q", int(fws.WG_ROWS)), ("desc_k", block_n), ("desc_v", block_n)):
        types[name] = _desc_type(_gluon_desc(t, [1, 1, rows, D]))
    return lambda: _compile(fws.attn_fwd_ws_kernel, consts, types, GOPTS, True)


def _gluon_bwd(bws, D: int, causal: bool, softcap: bool):
    """Thunk compiling `flash_bwd_ws.attn_bwd_ws_kernel` at head dim D with the config of WS_BWD."""
    import torch

    block_m, stages, early_dv = WS_BWD[D]
    block_n = int(bws.WG_ROWS) * int(bws.NUM_CONSUMERS)
    t = torch.empty(1, 1, 256, D, dtype=torch.bfloat16)
    rows = _gluon_desc(torch.empty(256, dtype=torch.float32), [block_m])
    dqa = torch.empty(1, 1, 256, D, dtype=torch.float32)
    dqa_block = [1, 1, 64, D] if block_m == 128 else [1, 1, block_m, D // 2]
    consts = dict(BLOCK_D=D, HAS_LO=False, HAS_HI=causal, BLOCK_M=block_m, STAGES=stages, EARLY_DV=early_dv,
                  CONSUMER_REGS=240, PRODUCER_REGS=24, DQ_TMA=True, SOFTCAP=softcap)  # fmt: skip
    types = {"DK": "*bf16", "DV": "*bf16", "DQA": "*fp32", "qk_scale": "fp32", "sm_scale": "fp32",
             "softcap_scale": "fp32"}  # fmt: skip
    for name, r in (("desc_q", block_m), ("desc_k", block_n), ("desc_v", block_n), ("desc_do", block_m)):
        types[name] = _desc_type(_gluon_desc(t, [1, 1, r, D]))
    types["desc_lse2"] = types["desc_delta"] = _desc_type(rows)
    types["desc_dqa"] = _desc_type(_gluon_desc(dqa, dqa_block))
    return lambda: _compile(bws.attn_bwd_ws_kernel, consts, types, GOPTS, True)


# the block-sparse kernels' mask tables (`BlockMask.kernel_tensors`): int32 lists and per-token tensors, uint8 tiles
_MASK_TYPES = {n: "*i32" for n in ("KV_NUM", "KV_IDX", "Q_NUM", "Q_IDX", "FULL_NUM", "FULL_IDX", "QDOC", "KDOC",
                                   "QPOS", "KPOS", "TILE_IDS", "SCHED", "CNT")}  # fmt: skip
_MASK_TYPES["TILES"] = "*u8"


def _gluon_sparse_fwd(sws, D: int, softcap: bool):
    """Thunk compiling `flash_sparse_ws.sparse_fwd_ws_kernel` at head dim D with the config of SPARSE_WS_FWD, for
    causal packed documents (MASK_KIND 3: their per-token intervals; 128-token blocks, Sk a multiple of them)."""
    import torch

    block_n, stages, pipe = SPARSE_WS_FWD[D]
    t = torch.empty(1, 1, 256, D, dtype=torch.bfloat16)
    consts = dict(BLOCK_D=D, MASK_BS=128, MASK_KIND=3, HAS_DOC=True, HAS_GLOBAL=False, EVEN_SK=True, BLOCK_N=block_n,
                  STAGES=stages, PIPE=pipe, CONSUMER_REGS=240, PRODUCER_REGS=24, SOFTCAP=softcap)  # fmt: skip
    types = {**_MASK_TYPES, "LSE": "*fp32", "qk_scale": "fp32", "softcap_scale": "fp32"}
    for name, rows in (("desc_q", int(sws.WG_ROWS)), ("desc_k", block_n), ("desc_v", block_n),
                       ("desc_o", int(sws.WG_ROWS))):  # fmt: skip
        types[name] = _desc_type(_gluon_desc(t, [1, 1, rows, D]))
    return lambda: _compile(sws.sparse_fwd_ws_kernel, consts, types, GOPTS, True)


def _gluon_sparse_bwd(sws, D: int, softcap: bool):
    """Thunk compiling `flash_sparse_ws.sparse_bwd_ws_kernel` at head dim D with the config of SPARSE_WS_BWD, for
    the mask of `_gluon_sparse_fwd` (Sq and Sk multiples of the block)."""
    import torch

    block_m, stages, early_dv = SPARSE_WS_BWD[D]
    rows = int(sws.CTA_ROWS)
    t = torch.empty(1, 1, 256, D, dtype=torch.bfloat16)
    dqa = torch.empty(1, 1, 256, D, dtype=torch.float32)
    dqa_block = [1, 1, 64, D] if block_m == 128 else [1, 1, block_m, D // 2]
    consts = dict(BLOCK_D=D, MASK_BS=128, MASK_KIND=3, HAS_DOC=True, HAS_GLOBAL=False, EVEN=True, BLOCK_M=block_m,
                  STAGES=stages, EARLY_DV=early_dv, CONSUMER_REGS=240, PRODUCER_REGS=24, SOFTCAP=softcap)  # fmt: skip
    types = {**_MASK_TYPES, "DK": "*bf16", "DV": "*bf16", "DQA": "*fp32", "qk_scale": "fp32", "sm_scale": "fp32",
             "softcap_scale": "fp32"}  # fmt: skip
    for name, r in (("desc_q", block_m), ("desc_k", rows), ("desc_v", rows), ("desc_do", block_m)):
        types[name] = _desc_type(_gluon_desc(t, [1, 1, r, D]))
    types["desc_lse2"] = types["desc_delta"] = _desc_type(_gluon_desc(torch.empty(256, dtype=torch.float32), [block_m]))
    types["desc_dqa"] = _desc_type(_gluon_desc(dqa, dqa_block))
    if block_m != rows:  # dK / dV leave through descriptors with 64-row query tiles (`launchers.sparse._backward_ws`)
        types["desc_dk"] = types["desc_dv"] = _desc_type(_gluon_desc(t, [1, 1, int(sws.WG_ROWS), D]))
    else:
        types["desc_dk"] = types["desc_dv"] = "*bf16"
    return lambda: _compile(sws.sparse_bwd_ws_kernel, consts, types, GOPTS, True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tree", help="a source tree: the folder holding src/longctx")
    parser.add_argument("-k", default="", help="only the cases whose name contains this")
    parser.add_argument("--dump", default="", help="a folder: write each case's stripped SASS there, to diff")
    parser.add_argument("--regs", action="store_true", help="add registers, stack frame and spill instructions")
    args = parser.parse_args()
    sys.path.insert(0, os.path.join(os.path.abspath(args.tree), "src"))
    import longctx

    print(f"# {os.path.dirname(longctx.__file__)}", file=sys.stderr)
    with tempfile.TemporaryDirectory() as workdir:
        for name, build in cases():
            if args.k not in name:
                continue
            try:
                kernel = build()
                digest, n, shared, body = _sass(kernel, workdir)
                if args.dump:
                    os.makedirs(args.dump, exist_ok=True)
                    with open(os.path.join(args.dump, name.replace(" ", "_").replace("=", "") + ".sass"), "w") as f:
                        f.write(body + "\n")
                extra = f" {_regs(kernel, workdir, body)}" if args.regs else ""
                print(f"{name:32s} {digest} instr={n} shared={shared}{extra}", flush=True)
            except Exception as exc:  # reported per case
                print(f"{name:32s} ERROR {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                      flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
