"""`longctx.warmup` on the GPU: with the process's kernel caches emptied, it records the launches of forward and
backward (dense and packed documents), compiles them concurrently without errors, and afterwards the same calls
compile nothing (Triton's jit_cache_hook sees no cache miss) and give the reference's results."""

from __future__ import annotations

import importlib

import pytest
import torch

import longctx
from longctx import warmup as wu

pytestmark = pytest.mark.gpu

_KERNEL_MODULES = (
    "longctx.kernels.triton.flash_fwd",
    "longctx.kernels.triton.flash_bwd",
    "longctx.kernels.triton.flash_sparse",
    "longctx.kernels.gluon.flash_fwd_ws",
    "longctx.kernels.gluon.flash_bwd_ws",
    "longctx.kernels.gluon.flash_sparse_ws",
    "longctx.kernels.triton.pointwise",
)


def _forget_compiled_kernels() -> None:
    """Empty the in-process caches of every longctx kernel (the on-disk cache stays: loading from it is a miss too)."""
    for name in _KERNEL_MODULES:
        try:
            mod = importlib.import_module(name)
        except Exception:  # a Triton without Gluon
            continue
        for obj in vars(mod).values():
            if hasattr(obj, "device_caches"):
                obj.device_caches.clear()


def test_warmup_compiles_everything_the_calls_need():
    triton = pytest.importorskip("triton")
    knobs = getattr(triton, "knobs", None)
    if knobs is None or not hasattr(knobs.runtime, "jit_cache_hook"):
        pytest.skip("this Triton has no jit_cache_hook")
    masks = ["causal", "full", "documents"]
    kw = dict(head_dim=64, n_heads=4, n_kv_heads=2, dtype=torch.bfloat16, window=None, backend="triton")
    _forget_compiled_kernels()
    report = wu.warmup(masks=masks, max_seq_len=2048, workers=8, **{k: v for k, v in kw.items() if k != "window"})
    assert report.kernels and report.failed == []
    assert [(m, s) for m, s, _ in report.calls] == wu._plan(masks, None, 2048)

    misses = []
    old = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = lambda *a, **k: misses.append(k.get("fn", a))
    try:
        gen = torch.Generator().manual_seed(0)
        for mask, S in wu._plan(masks, None, 2048):
            wu._call(mask, S, kw["head_dim"], kw["n_heads"], kw["n_kv_heads"], kw["dtype"], None, "triton", 0.0,
                     torch.device("cuda"), gen)  # fmt: skip
        torch.cuda.synchronize()
    finally:
        knobs.runtime.jit_cache_hook = old
    assert misses == []


def test_results_after_warmup_match_the_reference():
    _forget_compiled_kernels()
    wu.warmup(head_dim=64, n_heads=4, n_kv_heads=2, masks=["causal"], max_seq_len=1024, backend="triton")
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 4, 1000, 64, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    k, v = (torch.randn(1, 2, 1000, 64, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
            for _ in range(2))  # fmt: skip
    out = longctx.attention(q, k, v, causal=True, backend="triton")
    out.float().square().sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = longctx.attention(qd, kd, vd, causal=True, backend="math")
    ref.square().sum().backward()
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    for got, want in zip(grads, (qd.grad, kd.grad, vd.grad)):
        torch.testing.assert_close(got.double(), want, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("documents", [False, True])
def test_trainer_compile_ahead_leaves_the_first_step_nothing_to_compile(tmp_path, documents):
    """`longctx train`'s compile-ahead (attention through `warmup`, the position-wise kernels from one layer on a
    stand-in sequence): with the kernel caches emptied first, the first training step misses no position-wise
    kernel in Triton's cache."""
    triton = pytest.importorskip("triton")
    knobs = getattr(triton, "knobs", None)
    if knobs is None or not hasattr(knobs.runtime, "jit_cache_hook"):
        pytest.skip("this Triton has no jit_cache_hook")
    from longctx.training.config import parse_config
    from longctx.training.metrics import Progress
    from longctx.training.trainer import Trainer

    flags = ["--preset", "tiny", "--hidden-size", "256", "--ffn-hidden-size", "512", "--seq-length", "512",
             "--micro-batch-size", "2", "--quiet", "--save", "none", "--eval-iters", "0"]  # fmt: skip
    if documents:
        text = tmp_path / "docs.txt"
        text.write_bytes(b"\x00".join(b"document %d " % i * (i % 7 + 3) for i in range(400)))
        flags += ["--data", str(text), "--doc-separator", "\\x00"]
    trainer = Trainer(parse_config(flags))
    _forget_compiled_kernels()
    pointwise = ("rmsnorm", "rope", "swiglu")
    misses: dict[str, list[str]] = {"ahead": [], "step": []}
    phase = "ahead"
    old = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = lambda *a, **k: misses[phase].append(str(k.get("repr") or k.get("fn", a)))
    try:
        trainer._compile_ahead(Progress(1, True, 1))
        phase = "step"
        trainer.train_step(0)
        torch.cuda.synchronize()
    finally:
        knobs.runtime.jit_cache_hook = old
    # the hook sees these kernels compile ahead (so it would see a miss), and the step misses none of them
    assert {p for p in pointwise for m in misses["ahead"] if p in m} == set(pointwise)
    assert [m for m in misses["step"] if any(p in m for p in pointwise)] == []
