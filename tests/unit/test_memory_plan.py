"""The memory model (a counted trace of the real step on shape-only tensors) and the planner."""

from __future__ import annotations

import re

import pytest
import torch

import longctx
from longctx.memory import model as memory_model
from longctx.memory.plan import describe, format_plan, parse_bytes, plan
from longctx.models.gpt import GPT, GPTConfig
from tests.memory_steps import real_step_peak

FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
BASE = dict(
    vocab_size=512, seq_length=256, num_layers=3, hidden_size=64, num_attention_heads=4, num_query_groups=2,
    ffn_hidden_size=128, attention_backend="tiled",
)  # fmt: skip
PLANS = [
    {},
    FULL,
    dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2),
    dict(FULL, sequence_chunk_size=64),
    dict(FULL, recompute_skip_core_attention=True),
    dict(FULL, cpu_offloading=True, cpu_offloading_num_layers=2),
]


@pytest.mark.parametrize("kw", PLANS, ids=lambda kw: describe(GPTConfig(**BASE, **kw)))
def test_trace_counts_what_the_real_step_holds(kw):
    """The shape-only trace equals the same step run for real on the CPU (the attention kernels' twin in both)."""
    cfg = GPTConfig(**BASE, **kw)
    est = memory_model.step_memory(cfg, seq_length=256, micro_batch_size=2, exact=True)
    torch.manual_seed(0)
    model = GPT(cfg)
    model.set_core_attention(memory_model._twin_attention)
    for layer in model.layers:
        layer.self_attention.keep_core_attention = cfg.recompute_skip_core_attention
    # real CPU tensors are not offloaded (there is no other memory): the trace moves them; count them back in
    real = real_step_peak(model, torch.zeros(2, 256, dtype=torch.long))
    if cfg.cpu_offloading:
        assert est.traced <= real <= est.traced + est.host_offloaded
    else:
        assert est.traced == real
    assert est.parameters == 4 * model.num_parameters() and est.optimizer_states == 8 * model.num_parameters()
    assert sum(b for _, b in est.rows()) == est.total


def test_gradients_and_checkpoints_are_not_counted_as_held_at_once():
    """A deep model under full recompute: its peak comes late in the backward, when most layers' checkpoints are gone
    and their gradients have come. The prediction is the real step's peak, not the gradients plus every checkpoint,
    and the table says what was freed."""
    cfg = GPTConfig(**dict(BASE, num_layers=16, hidden_size=128, ffn_hidden_size=256, vocab_size=128), **FULL)
    est = memory_model.step_memory(cfg, seq_length=128, micro_batch_size=1, exact=True)
    torch.manual_seed(0)
    model = GPT(cfg)
    model.set_core_attention(memory_model._twin_attention)
    assert est.traced == real_step_peak(model, torch.zeros(1, 128, dtype=torch.long))
    assert 0 < est.freed_before_peak < est.checkpoints and est.traced < est.gradients + est.checkpoints
    assert est.working_set == 0 and sum(b for _, b in est.rows()) == est.total
    assert any(b == -est.freed_before_peak for _, b in est.rows())


@pytest.mark.parametrize("kw", [FULL, dict(FULL, sequence_chunk_size=256, recompute_skip_core_attention=True), {}])
def test_long_lengths_read_off_two_shorter_traces(kw, monkeypatch):
    """Beyond the direct-trace length the peak is read off the line through two shorter traces: equal to a trace of
    the length itself."""
    monkeypatch.setattr(memory_model, "DIRECT_TRACE_TOKENS", 1024)
    cfg = GPTConfig(**BASE, **kw)
    memory_model.step_memory.cache_clear()
    far = memory_model.step_memory(cfg, seq_length=8192)
    direct = memory_model.step_memory(cfg, seq_length=8192, exact=True)
    assert far.total == direct.total
    assert (far.checkpoints, far.kept_attention) == (direct.checkpoints, direct.kept_attention)


def test_settings_order_the_memory():
    m = {k: memory_model.step_memory(GPTConfig(**BASE, **v), seq_length=2048).total for k, v in
         {"none": {}, "full": FULL, "chunks": dict(FULL, sequence_chunk_size=64),
          "offload": dict(FULL, cpu_offloading=True)}.items()}  # fmt: skip
    assert m["none"] > m["full"] > m["offload"]
    assert m["chunks"] < m["full"]


def test_plan_picks_the_cheapest_that_fits():
    cfg = GPTConfig(**BASE)
    loose = plan(cfg, seq_length=2048, budget="1GiB")
    assert loose.config.recompute_granularity is None  # nothing to save: no recompute
    none = loose.memory.total
    frugal = memory_model.step_memory(cfg.replace(**FULL, cpu_offloading=True), seq_length=2048).total
    tight_budget = (none + frugal) // 2
    tight = plan(cfg, seq_length=2048, budget=tight_budget)
    assert tight.memory.total <= tight_budget < none
    assert tight.config.recompute_granularity == "full"
    assert "recompute" in format_plan(tight) and "total" in format_plan(tight)


def test_impossible_plans_say_what_is_needed():
    cfg = GPTConfig(**BASE)
    static = 16 * GPT(cfg).num_parameters()
    # below the states alone: only offloading them can fit; refused when offloading is ruled out, saying by how much
    wide = GPTConfig(**{**BASE, "num_layers": 8, "hidden_size": 512, "ffn_hidden_size": 1408})  # states >> activations
    static_wide = 16 * GPT(wide).num_parameters()
    budget = memory_model.CUDA_OVERHEAD_BYTES + static_wide // 2
    with pytest.raises(ValueError, match=r"needs GPU .* \(budget .*\); GPU is short by .* GiB\. No length fits these "
                       r"budgets; offload_params \(parameters in host memory\) may train longer"):  # fmt: skip
        plan(wide, seq_length=512, budget=budget, offload_params=False)
    p = plan(wide, seq_length=512, budget=budget)
    assert p.offload_params and p.memory.total <= budget
    # the units beside the activations that the budget holds stay on the GPU, the others' states go to the host
    assert 0 < p.resident_units < memory_model.resident_units_of(wide)
    assert p.memory.host_states == memory_model.offloaded_state_bytes(wide, 1, resident_units=p.resident_units)
    with pytest.raises(ValueError, match=r"needs GPU .* \(budget .*\); GPU is short by .* GiB\. (The longest sequence "
                       r"these budgets train is about [\d,]+ tokens|No length fits these budgets)"):  # fmt: skip
        plan(cfg, seq_length=1 << 16, budget=static + (1 << 20) + memory_model.CUDA_OVERHEAD_BYTES)


def test_the_longest_length_named_trades_the_gpu_for_the_host():
    """An impossible request names the longest length the budgets train, and that length plans. With a host budget
    the most frugal plan (every checkpoint offloaded) is not the one that fits longest: here the host takes no
    offloaded checkpoint at all, and the plan that keeps them on the GPU trains 8K."""
    cfg = GPTConfig(**dict(BASE, num_layers=4, hidden_size=256, ffn_hidden_size=512))
    budget, host = 390_000 << 10, 2_625_000 << 10  # the host: the process's allowance and 3.4 MiB besides
    assert plan(cfg, seq_length=8192, budget=budget, host_budget=host).memory.host_offloaded == 0
    with pytest.raises(ValueError, match=r"The longest sequence these budgets train is about") as err:
        plan(cfg, seq_length=65536, budget=budget, host_budget=host)
    longest = int(re.search(r"about ([\d,]+) tokens", str(err.value)).group(1).replace(",", ""))
    assert 8192 <= longest < 65536
    plan(cfg, seq_length=longest, budget=budget, host_budget=host)


@pytest.mark.parametrize(
    "text,expected",
    [("40GiB", 40 << 30), ("40 GB", 40 << 30), ("512MiB", 512 << 20), ("1.5TiB", int(1.5 * (1 << 40))),
     (1 << 30, 1 << 30)],
)  # fmt: skip
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["forty", "-3GiB", "0GiB", "12 parsecs"])
def test_parse_bytes_rejects(bad):
    with pytest.raises(ValueError, match="budget"):
        parse_bytes(bad)


def test_a_size_without_a_unit_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"budget needs a unit: '40' has none; write 40GiB"):
        parse_bytes("40")
    with pytest.raises(ValueError, match=r"budget=40 would be 40 bytes; give the unit: budget='40GiB'"):
        parse_bytes(40)


def test_the_planned_config_trains_at_the_planned_length():
    cfg = GPTConfig(**BASE)
    p = plan(cfg, seq_length=2048, budget="8GiB")
    assert cfg.seq_length != 2048 and p.config.seq_length == 2048
    assert isinstance(p.settings, dict) and p.settings["recompute_granularity"] == p.config.recompute_granularity


def test_plan_cli_counts_and_sizes(capsys):
    from longctx.cli.main import main

    assert main(["plan", "--preset", "tiny", "--seq-length", "1e3", "--budget", "2GiB"]) == 0
    assert "plan for S=1,000" in capsys.readouterr().out
    assert main(["plan", "--preset", "tiny", "--seq-length", "1000", "--budget", "40"]) == 2
    assert "budget needs a unit: '40' has none; write 40GiB" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "--preset", "tiny", "--seq-length", "1.5e2x", "--budget", "2GiB"])
    assert "--seq-length must be a whole number" in capsys.readouterr().err


def test_public_name():
    assert longctx.plan is plan


def test_train_memory_budget_applies_the_plan():
    """`longctx train --memory-budget` trains with the plan's settings for its batch and length."""
    from longctx.training.config import parse_config
    from longctx.training.trainer import Trainer

    demo = GPTConfig.preset("demo")
    none = memory_model.step_memory(demo, seq_length=demo.seq_length, micro_batch_size=32).total
    full = demo.replace(**FULL, cpu_offloading=True, sequence_chunk_size=32)
    frugal = memory_model.step_memory(full, seq_length=demo.seq_length, micro_batch_size=32).total
    budget = (none + frugal) // 2
    cfg = parse_config(["--train-iters", "1", "--save", "none", "--eval-iters", "0", "--quiet",
                        "--memory-budget", f"{budget}B"])  # fmt: skip
    trainer = Trainer(cfg)
    assert trainer.model_config.recompute_granularity == "full"
    with pytest.raises(ValueError, match="memory_budget"):
        parse_config(["--memory-budget", "lots"])


def test_offloaded_states_count_the_pinned_blocks():
    """FSDP2 pins each parameter's shard and its gradient, and torch's pinned allocator rounds every block up to a
    power of two: llama-8b's fused q/k/v (96 MiB in float32), gate/up (448 MiB) and down (224 MiB) projections
    take 128, 512 and 256 MiB, the embedding and the output projection (1.96 GiB each) 2 GiB; AdamW's states are
    not pinned."""
    from longctx.models.gpt import PRESETS

    c = GPTConfig(**PRESETS["llama-8b"])
    params = 8_030_261_248
    MiB = 1 << 20
    per_layer = 2 * (32 + 64 + 32) * MiB  # weight and gradient of qkv, fc1 and fc2, rounded
    embedding = 2 * 2 * ((1 << 31) - 128256 * 4096 * 4)  # weight and gradient, input embedding and output
    assert memory_model.offloaded_state_bytes(c, 1) == 16 * params + 32 * per_layer + embedding
    assert memory_model.pinned_block_bytes(96 * MiB) == 128 * MiB
    assert memory_model.pinned_block_bytes(64 * MiB) == 64 * MiB
    # two shards: each rank pins half of every parameter's rows (the 64 MiB projection: 32 MiB, still a power of 2)
    two = memory_model.offloaded_state_bytes(c, 2)
    assert two == 8 * params + 32 * per_layer // 2 + 2 * 2 * ((1 << 30) - 64128 * 4096 * 4)


def test_context_parallel_traces_the_method_and_keeps_no_attention_outputs():
    """Under context parallelism the trace runs the method's own code: the ring leaves each layer what one process
    leaves (its output in q's layout: the output projection's input is a view, not a copy), and its backward holds
    its accumulators on top; kept attention outputs are refused there and never planned."""
    cfg = GPTConfig(**BASE, **FULL)
    plain = memory_model.step_segments(GPTConfig(**BASE), seq_length=256, exact=True)[1]
    ring = memory_model.step_segments(GPTConfig(**BASE), seq_length=256, exact=True, context_parallel=4)[1]
    assert ring["forward end"] == plain["forward end"]
    assert max(ring.values()) >= max(plain.values())
    with pytest.raises(ValueError, match="recompute_skip_core_attention does not apply under context parallelism"):
        memory_model.step_memory(cfg.replace(recompute_skip_core_attention=True), seq_length=256, context_parallel=2)
    with pytest.raises(ValueError, match="cp_method must be one of"):
        memory_model.step_memory(cfg, seq_length=256, context_parallel=2, cp_method="mesh")
    from longctx.memory.plan import _candidates

    assert any(c.recompute_skip_core_attention for c in _candidates(cfg, 256))
    assert not any(c.recompute_skip_core_attention for c in _candidates(cfg, 256, context_parallel=2))
    p = plan(GPTConfig(**BASE), seq_length=1024, budget="1GiB", context_parallel=4, cp_method="allgather")
    assert not p.config.recompute_skip_core_attention and p.cp_method == "allgather"
    assert "context parallel 4 (allgather)" in format_plan(p)


def test_impossible_plan_names_the_micro_batch():
    with pytest.raises(ValueError, match=r"no plan trains S=2,048 in micro batches of 8 sequences in 0.01 GiB"):
        plan(GPTConfig(**BASE), seq_length=2048, budget="0.01GiB", micro_batch_size=8)
