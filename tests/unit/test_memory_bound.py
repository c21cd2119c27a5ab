"""The planner's lower bound on a plan's predicted peak (`_PeakBound`, no trace of the plan) against the prediction
itself, for every candidate plan of small float32 models on the CPU: a bound, so skipping plans by it cannot change
the plan chosen."""

from __future__ import annotations

import pytest

from longctx.memory import model as memory_model
from longctx.memory.plan import _candidates, _PeakBound, describe, plan
from longctx.models.gpt import GPTConfig

SMALL = dict(
    vocab_size=512, seq_length=256, num_layers=5, hidden_size=64, num_attention_heads=4, num_query_groups=2,
    ffn_hidden_size=128, attention_backend="tiled",
)  # fmt: skip
CONFIGS = {
    "5 layers": GPTConfig(**SMALL),
    "3 layers, 8 kv heads, wide ffn, big vocab": GPTConfig(
        **dict(SMALL, num_layers=3, num_query_groups=4, ffn_hidden_size=512, vocab_size=4096)
    ),
}


@pytest.mark.parametrize("S", [512, 4096])  # 4096: read off two shorter traces (direct-trace length 1024 here)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_bound_is_below_every_candidates_prediction(name, S, monkeypatch):
    monkeypatch.setattr(memory_model, "DIRECT_TRACE_TOKENS", 1024)
    memory_model.step_memory.cache_clear()
    config = CONFIGS[name]
    bound = _PeakBound(config, S, 1)
    checked = 0
    for c in _candidates(config, S):
        low, total = bound.lower(c), memory_model.step_memory(c, seq_length=S).total
        assert low is not None, describe(c)
        assert low <= total, f"{describe(c)}: bound {low} > predicted {total}"
        checked += 1
    assert checked == len(_candidates(config, S))
    memory_model.step_memory.cache_clear()


def test_plans_with_and_without_the_bound_agree(monkeypatch):
    """The plan chosen for tight and roomy budgets is the one the walk without the bound chooses."""
    config = CONFIGS["5 layers"]
    S = 2048
    totals = sorted({memory_model.step_memory(c, seq_length=S).total for c in _candidates(config, S)})
    budgets = [totals[0], totals[len(totals) // 3], totals[len(totals) // 2], totals[-1]]
    chosen = {b: plan(config, seq_length=S, budget=b) for b in budgets}
    monkeypatch.setattr(_PeakBound, "lower", lambda self, c: None)
    for b, p in chosen.items():
        q = plan(config, seq_length=S, budget=b)
        assert (q.config, q.memory) == (p.config, p.memory)
