"""`launchers.runtime.launch`, `compile_ahead` and `compile_launches` (what `longctx.warmup` compiles with), with
stand-in kernels: recording instead of running, deduplication by Triton's specialisation, concurrent compilation,
errors reported rather than raised. The real kernels are compiled on the GPU (tests/gpu/test_warmup_gpu.py)."""

from __future__ import annotations

import threading
import time
from collections import defaultdict

import pytest
import torch

from longctx.launchers import runtime
from longctx.warmup import WarmupReport


class FakeKernel:
    """A jit kernel's surface: ``kernel[grid](...)`` runs, ``warmup`` compiles, ``device_caches[d][4]`` binds."""

    def __init__(self, name: str, compile_s: float = 0.0, fail: bool = False):
        self.__name__ = name
        self.compile_s, self.fail = compile_s, fail
        self.ran, self.compiled, self.threads, self.spans = [], [], set(), []
        self.device_caches = defaultdict(lambda: (None, None, None, None, self._bind))

    @staticmethod
    def _bind(*args, **kwargs):
        # the specialisation: the first argument's value and the constexpr keywords, as Triton's binder keys it
        return None, (args[0],), tuple(sorted(kwargs.items()))

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.ran.append((grid, args, kwargs))

    def warmup(self, *args, grid, **kwargs):
        self.threads.add(threading.get_ident())
        t0 = time.perf_counter()
        time.sleep(self.compile_s)
        self.spans.append((t0, time.perf_counter()))
        if self.fail:
            raise RuntimeError("PassManager::run failed\nmore detail")
        self.compiled.append((grid, args, kwargs))


class Autotuned:
    """An autotuned kernel (no ``device_caches``): always runs."""

    def __init__(self):
        self.ran = 0

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.ran += 1

        return run


def test_launch_runs_outside_compile_ahead():
    k = FakeKernel("k")
    runtime.launch(k, (2, 1), 7, BLOCK=64)
    assert k.ran == [((2, 1), (7,), {"BLOCK": 64})] and k.compiled == []


def test_compile_ahead_records_jit_launches_and_runs_the_others():
    k, auto = FakeKernel("k"), Autotuned()
    with runtime.compile_ahead() as launches:
        runtime.launch(k, (4,), 1, BLOCK=64)
        runtime.launch(auto, (4,), 1)
    assert k.ran == [] and auto.ran == 1
    assert launches == [(k, (4,), (1,), {"BLOCK": 64})]
    runtime.launch(k, (4,), 1, BLOCK=64)  # recording ends with the block
    assert len(k.ran) == 1


def test_compile_ahead_is_not_reentrant_and_ends_on_errors():
    with runtime.compile_ahead(), pytest.raises(RuntimeError, match="not reentrant"), runtime.compile_ahead():
        pass
    with pytest.raises(ValueError, match="boom"), runtime.compile_ahead():
        raise ValueError("boom")
    assert runtime._RECORDING is None


def test_compile_launches_compiles_each_specialisation_once_and_concurrently():
    a, b = FakeKernel("a", compile_s=0.3), FakeKernel("b", compile_s=0.3)
    launches = [
        (a, (1,), (16,), {"BLOCK": 64}),
        (a, (9,), (16,), {"BLOCK": 64}),  # another grid, the same binary
        (a, (1,), (16,), {"BLOCK": 128}),
        (b, (1,), (16,), {}),
    ]
    out = runtime.compile_launches(launches, torch.device("cpu"), workers=3)
    assert len(a.compiled) == 2 and len(b.compiled) == 1
    assert sorted(name for name, _, _ in out) == ["a", "a", "b"]
    assert all(err == "" and s >= 0.3 for _, s, err in out)
    # three compiles in three threads, all at once: each started before any ended
    spans = a.spans + b.spans
    assert len(a.threads | b.threads) == 3 and max(s for s, _ in spans) < min(e for _, e in spans)


def test_compile_launches_reports_errors_and_handles_nothing():
    bad, good = FakeKernel("bad", fail=True), FakeKernel("good")
    out = runtime.compile_launches([(bad, (1,), (1,), {}), (good, (1,), (2,), {})], torch.device("cpu"))
    assert ("bad", "RuntimeError: PassManager::run failed") in [(n, e) for n, _, e in out]
    assert [e for n, _, e in out if n == "good"] == [""]
    assert runtime.compile_launches([], torch.device("cpu")) == []


def test_launch_key_falls_back_to_no_dedup_when_binding_fails():
    class Unbindable(FakeKernel):
        @staticmethod
        def _bind(*args, **kwargs):
            raise TypeError("another Triton")

    k = Unbindable("k")
    out = runtime.compile_launches([(k, (1,), (1,), {}), (k, (1,), (1,), {})], torch.device("cpu"))
    assert len(out) == 2 and len(k.compiled) == 2


def test_warmup_report():
    rep = WarmupReport(compile_s=3.0, kernels=[("fwd", 2.5, ""), ("bwd", 2.9, ""), ("ws", 0.1, "RuntimeError: x")])
    rep.calls = [("causal", 1024, 0.01), ("causal", 2048, 0.02)]
    assert rep.seconds == pytest.approx(3.03)
    assert rep.failed == [("ws", "RuntimeError: x")]
    table = rep.table()
    assert "compiled 3 kernels in 3.00 s" in table and "add up to 5.50 s" in table
    assert "did not compile: ws: RuntimeError: x" in table


def test_launchers_run_every_kernel_through_runtime_launch():
    """A kernel launched as ``kernel[grid](...)`` outside `runtime.launch` would escape `compile_ahead` (the warm-up
    would then compile it one after the other in its real pass). Only the autotuned launches, whose grid is a
    function of the chosen config, may do so: they run in any case."""
    import ast
    from pathlib import Path

    folder = Path(runtime.__file__).parent
    tables = {"_PRE_HOOKS"}  # dicts of functions, called as table[key](...)
    direct = []
    for path in sorted(folder.glob("*.py")):
        if path.name == "runtime.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            call = isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
            if call and not isinstance(node.func.slice, ast.Lambda) and ast.unparse(node.func.value) not in tables:
                direct.append(f"{path.name}:{node.lineno}")
    assert direct == [], f"kernels launched around runtime.launch: {direct}"


@pytest.mark.parametrize("documents", [False, True])
def test_trainer_records_the_position_wise_kernels_of_a_layer_and_leaves_the_model_alone(
    recorded_pointwise_launches, documents
):
    """`Trainer._compile_pointwise_ahead`: with the launchers' path taken (as on a GPU), one layer's forward and
    backward on a stand-in sequence records RMSNorm, rotary and SwiGLU both ways, and nothing else (its core
    attention is a stand-in); the layer's attention comes back, and no parameter gets a gradient."""
    from longctx.training.config import parse_config
    from longctx.training.trainer import Trainer

    cfg = parse_config(["--preset", "tiny", "--quiet", "--device", "cpu", "--save", "none", "--eval-iters", "0"])
    trainer = Trainer(cfg)
    layer = trainer.model.layers[0]
    core = layer.self_attention.core_attention
    recorded = recorded_pointwise_launches
    report = trainer._compile_pointwise_ahead(documents)
    names = {k.__name__ for k, *_ in recorded}
    assert names == {
        "rmsnorm_fwd_kernel", "rmsnorm_bwd_kernel", "rope_kernel", "swiglu_fwd_kernel", "swiglu_bwd_kernel",
    }  # fmt: skip
    assert len(report) == len(recorded)
    # rotary both ways, on q and on k, over the 256-token stand-in
    ropes = [(args, kw) for k, _, args, kw in recorded if k.__name__ == "rope_kernel"]
    assert all(args[4] == 256 for args, _ in ropes)
    # q's heads and k's (tiny: 4 and 2, so two BLOCK_H binaries), each way: the first step meets no other
    heads = trainer.model_config.num_attention_heads, trainer.model_config.kv_heads
    assert heads[0] != heads[1]
    assert {(args[5], kw["BACKWARD"]) for args, kw in ropes} == {(h, b) for h in heads for b in (False, True)}
    cos = next(args[1] for args, _ in ropes)
    assert cos.dim() == (3 if documents else 2)  # positions shaped as training's: per row under documents
    assert layer.self_attention.core_attention is core
    assert all(p.grad is None for p in trainer.model.parameters())
