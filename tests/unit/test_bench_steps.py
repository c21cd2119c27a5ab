"""The training-step timer shared by `longctx bench memory` and `longctx bench transformers` (CPU)."""

from __future__ import annotations

import json

import pytest
import torch

from longctx.bench import memory, steps
from longctx.bench import transformers as bench_tf

CPU = torch.device("cpu")


def _linear_step():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    x = torch.randn(32, 16)
    return steps.training_step(lambda: model(x).square().mean(), steps.adamw(model, CPU), CPU)


def test_time_steps_gives_tokens_per_s_and_the_cpu_peak():
    r = steps.time_steps(_linear_step, tokens=32, steps=3, warmup=1, device=CPU)
    assert r.ok and not r.oom and r.code == steps.OK and r.error == ""
    assert r.step_s > 0 and r.tokens_per_s == pytest.approx(32 / r.step_s)
    assert r.peak_bytes > 0  # live tensors of one step: activations and gradients
    assert r.secs >= 3 * r.step_s


def test_training_step_updates_the_parameters():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    before = model.weight.detach().clone()
    step = steps.training_step(lambda: model(torch.randn(8, 4)).sum(), steps.adamw(model, CPU), CPU)
    step()
    assert not torch.equal(before, model.weight) and model.weight.grad is None


class _Fails:
    """A step that raises ``exc`` on call number ``at`` (0: when it is built)."""

    def __init__(self, exc: BaseException, at: int):
        self.exc, self.at, self.calls = exc, at, 0

    def __call__(self):
        if self.at == 0:
            raise self.exc
        return self.step

    def step(self):
        self.calls += 1
        if self.calls == self.at:
            raise self.exc


@pytest.mark.parametrize("at", [0, 1, 3])  # building, warm-up, timing
def test_out_of_memory_is_a_result_code(at):
    r = steps.time_steps(_Fails(torch.OutOfMemoryError("CUDA out of memory. Tried"), at), tokens=8, steps=3,
                         warmup=1, device=CPU)  # fmt: skip
    assert r.code == steps.OOM and r.oom and not r.ok
    assert r.error.startswith("OutOfMemoryError: CUDA out of memory")
    assert r.step_s is None and r.tokens_per_s is None and r.peak_bytes is None


def test_other_errors_are_recorded_with_their_message():
    r = steps.time_steps(_Fails(ValueError("bad shape"), 2), tokens=8, steps=2, warmup=1, device=CPU)
    assert r.code == steps.ERROR and r.error == "ValueError: bad shape"
    allocator = RuntimeError("DefaultCPUAllocator: not enough memory: out of memory")
    assert steps.time_steps(_Fails(allocator, 1), tokens=8, steps=1, warmup=0, device=CPU).oom


def test_bench_memory_cells_through_the_step_timer():
    from longctx.models.gpt import GPTConfig

    cfg = GPTConfig.preset("tiny")
    cell = memory._measure(memory._gpt_step_runner, cfg, 32, 2, 1, CPU)
    assert set(cell) == {"s", "status", "step_s", "tokens_per_s", "peak_bytes", "reserved_bytes", "host_peak_bytes",
                         "phases", "copies", "secs"}  # fmt: skip
    assert cell["status"] == "ok" and cell["tokens_per_s"] > 0 and cell["peak_bytes"] > 0
    assert cell["reserved_bytes"] is None  # the allocator's cache exists on CUDA only
    assert cell["host_peak_bytes"] > 0 and set(cell["phases"]) == {"forward_backward_s", "optimizer_s"}
    assert sum(cell["phases"].values()) <= cell["step_s"] * 1.5 and cell["copies"] is None  # profiled on CUDA only
    # the host's AdamW step behind the next forward (the default, as in training): timed through the same loop,
    # the last one waited for; and the same step taken in place
    offloaded = memory._measure(memory._gpt_step_runner, cfg, 32, 2, 1, CPU, offload_params=True)
    assert offloaded["status"] == "ok", offloaded
    in_place = memory._measure(memory._gpt_step_runner, cfg, 32, 2, 1, CPU, offload_params=True, overlap=False)
    assert in_place["status"] == "ok", in_place
    # overlapped: the step before's own time and what the forward after it waited, beside the phases
    assert offloaded["phases"]["host_step_s"] > 0 and offloaded["phases"]["forward_waited_s"] >= 0
    assert "host_step_s" not in in_place["phases"]
    hf = memory._measure(memory._hf_step_runner, cfg, 32, 1, 0, CPU)
    assert hf["status"] == "ok" and hf["tokens_per_s"] > 0

    def oom(config, S, device):
        raise torch.OutOfMemoryError("CUDA out of memory")

    cell_oom = memory._measure(oom, cfg, 32, 1, 0, CPU)
    assert cell_oom["status"] == "oom" and set(cell_oom) == {"s", "status", "error", "secs"}
    meta = {"preset": "tiny", "env": {"gpu": "cpu", "torch": torch.__version__}, "steps": 2, "warmup": 1,
            "command": "longctx bench memory"}  # fmt: skip
    off_row = {"s": 32, "plan": "q", "offload_params": True, "longctx": offloaded, "predicted_bytes": 1 << 20,
               "predicted_host_bytes": 2 << 30, "model_flops": memory.model_flops(cfg, 32)}  # fmt: skip
    md = memory.report(meta, [{"s": 32, "plan": "p", "longctx": cell, "hf": hf}, {"s": 64, "longctx": cell_oom},
                              off_row])  # fmt: skip
    assert "| 32 | p | " in md and "| 64 | - | oom | - |" in md
    assert "## Parameters, gradients and optimizer states in host memory (tiny)" in md and "\n| 32 | q | " in md
    row = next(line for line in md.splitlines() if line.startswith("| 32 | q | "))
    header = next(line for line in md.splitlines() if line.startswith("| S | plan | tokens/s | step s"))
    assert row.count("|") == header.count("|")  # every column filled
    cells = dict(zip(header.split("|"), row.split("|"), strict=True))
    assert float(cells[" host step s "]) == round(offloaded["phases"]["host_step_s"], 2)


def test_bench_transformers_runner_through_the_step_timer(monkeypatch):
    runner = bench_tf.Runner("longctx-apply", bench_tf.SHAPE_QUICK, 128, CPU)
    r = runner.run(64, 1, 0, None)
    assert set(r) == {"s", "step_ms", "tokens_per_s", "peak_bytes", "reserved_bytes", "status", "secs", "peak"}
    assert r["status"] == "ok" and r["tokens_per_s"] > 0 and r["peak"] == r["peak_bytes"] > 0
    assert runner.run(64, 1, 0, cap_bytes=1)["status"] == "over"  # a peak above the cap does not fit
    assert runner.model is not None  # kept for the next length

    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(bench_tf, "measure", lambda *a, **k: steps.time_steps(oom, tokens=64, steps=1, warmup=0,
                                                                              device=CPU))  # fmt: skip
    r = runner.run(64, 1, 0, None)
    assert r["status"] == "over" and r["peak"] == float("inf") and r["error"].startswith("OutOfMemoryError")
    assert runner.model is None  # released after running out of memory
    monkeypatch.setattr(bench_tf, "build", lambda *a, **k: (_ for _ in ()).throw(ValueError("no such model")))
    r = runner.run(64, 1, 0, None)
    assert r["status"] == "error" and r["error"] == "ValueError: no such model"


@pytest.mark.parametrize("provider", ["hf-eager-ckpt", "longctx-apply"])
def test_bench_transformers_gemma2_runner(provider):
    """The Gemma-2-shaped model (head dim, softcap, sliding-window layers) trains a step under each provider."""
    pytest.importorskip("transformers")
    runner = bench_tf.Runner(provider, bench_tf.SHAPE_GEMMA2_QUICK, 128, CPU, "gemma2")
    r = runner.run(64, 1, 0, None)
    assert r["status"] == "ok" and r["tokens_per_s"] > 0
    assert runner.model.config.attn_logit_softcapping == 50.0 and "sliding_attention" in runner.model.config.layer_types


@pytest.mark.parametrize("provider", ("hf-sdpa-ckpt", "longctx-apply", "longctx-apply-offload-keep"))
def test_bench_transformers_lora_runner_trains_only_the_adapters(provider):
    pytest.importorskip("peft")
    runner = bench_tf.Runner(provider, bench_tf.SHAPE_QUICK, 128, CPU, "llama-8b", lora_rank=4)
    r = runner.run(64, 1, 0, None)
    assert r["status"] == "ok", r
    trained = {id(p) for g in runner.opt.param_groups for p in g["params"]}
    named = dict(runner.model.named_parameters())
    assert trained and all(id(p) in trained for n, p in named.items() if "lora_" in n)
    assert all(id(p) not in trained and p.dtype == torch.bfloat16 for n, p in named.items() if "lora_" not in n)
    if provider.startswith("longctx"):  # the step traced on the model itself
        assert bench_tf.predicted_peak(provider, bench_tf.SHAPE_QUICK, 64, "llama-8b", 4) > 0


def test_bench_transformers_keep_providers_keep_attention():
    keep = {p: bench_tf.apply_settings(p) for p in ("longctx-apply-keep", "longctx-apply-offload-keep")}
    assert all(p in bench_tf.PROVIDERS for p in keep)
    assert all(s["recompute_skip_core_attention"] and s["recompute_granularity"] == "full" for s in keep.values())
    assert [s["cpu_offloading"] for s in keep.values()] == [False, True]
    others = [p for p in bench_tf.PROVIDERS if p.startswith("longctx") and p not in keep]
    assert not any(bench_tf.apply_settings(p)["recompute_skip_core_attention"] for p in others)


def test_bench_transformers_offload_params_runner_keeps_the_states_on_the_host():
    """`longctx-apply-offload-params`: `apply(offload_params=True)` with offloaded checkpoints and MLP chunks, AdamW
    over host parameters; its rows carry the host's peak, its prediction the host's too; LoRA is refused."""
    pytest.importorskip("transformers")
    p = bench_tf.OFFLOAD_PARAMS
    settings = bench_tf.apply_settings(p)
    assert settings["offload_params"] and settings["cpu_offloading"] and settings["sequence_chunk_size"] == 4096
    assert all("offload_params" not in bench_tf.apply_settings(q) for q in bench_tf.PROVIDERS if q != p)
    runner = bench_tf.Runner(p, bench_tf.SHAPE_QUICK, 128, CPU, "llama-8b")
    r = runner.run(64, 1, 0, None)
    assert r["status"] == "ok" and r["host_peak_bytes"] > 0, r
    trained = [q for g in runner.opt.param_groups for q in g["params"]]
    assert trained and all(q.device.type == "cpu" for q in trained)
    assert len(trained) == len(list(runner.model.parameters()))  # every weight trains
    pred = bench_tf.predicted_step(p, bench_tf.SHAPE_QUICK, 64, "llama-8b", None)
    assert pred.total > 0 and pred.host > pred.total  # the fp32 states live on the host
    r = bench_tf.Runner(p, bench_tf.SHAPE_QUICK, 128, CPU, "llama-8b", lora_rank=4).run(64, 1, 0, None)
    assert r["status"] == "error" and "longctx-apply-offload-chunks" in r["error"]
    with pytest.raises(SystemExit):
        bench_tf.main(["--quick", "--model", "llama-8b", "--lora", "--providers", p])


def test_bench_transformers_keeps_finished_rows_when_stopped(monkeypatch, tmp_path):
    """The report is written after every row: a run killed mid-way (a time limit) leaves the rows it finished."""
    calls = []

    def run(self, s, steps, warmup, cap):
        calls.append(s)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the second row never finishes
        return {"s": s, "step_ms": 1.0, "tokens_per_s": 64e3, "peak_bytes": 1 << 20, "reserved_bytes": None,
                "status": "ok", "secs": 0.0, "peak": 1 << 20}  # fmt: skip

    monkeypatch.setattr(bench_tf.Runner, "run", run)
    monkeypatch.setattr(bench_tf, "predicted_step", lambda *a, **k: type("P", (), {"total": 1 << 20, "host": 0}))
    with pytest.raises(KeyboardInterrupt):
        bench_tf.main(["--quick", "--providers", "hf-sdpa-ckpt", "--out-dir", str(tmp_path)])
    (json_file,) = tmp_path.glob("*.json")
    rows = json.loads(json_file.read_text())["ladder"]["hf-sdpa-ckpt"]
    assert [r["s"] for r in rows] == [64] and "| 64 | 64000 |" in json_file.with_suffix(".md").read_text()
