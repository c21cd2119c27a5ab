"""The memory model's fast paths against the trace they stand for: byte for byte on tiny float32 models on the CPU."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from longctx.memory import model as memory_model
from longctx.memory.plan import _candidates, describe
from longctx.models.gpt import GPTConfig

# nine layers: runs of up to nine identical layers, cut to `RUN_LAYERS` in the fast trace
DEEP = dict(
    vocab_size=512, seq_length=256, num_layers=9, hidden_size=64, num_attention_heads=4, num_query_groups=2,
    ffn_hidden_size=128, attention_backend="tiled",
)  # fmt: skip
# every plan the planner considers (block recompute, kept attention, offloading), and some with sequence chunks
PLANS = _candidates(GPTConfig(**DEEP), 256)
CASES = [(c, torch.bfloat16) for c in PLANS] + [(c.replace(sequence_chunk_size=64), torch.bfloat16) for c in PLANS[::3]]
CASES += [(c, None) for c in PLANS[::4]]  # float32 throughout: no autocast cache


@pytest.mark.parametrize("cfg,autocast_dtype", CASES, ids=lambda v: describe(v) if isinstance(v, GPTConfig) else str(v))
def test_cut_runs_trace_equals_the_whole_model(cfg, autocast_dtype):
    """A model whose runs of identical layers are traced cut to a few layers and lengthened back: the same peak,
    the same peak in every segment of the timeline, the same breakdown, as the trace of every layer."""
    assert memory_model._cut_runs(cfg) is not None
    kw = dict(seq_length=256, micro_batch_size=2, autocast_dtype=autocast_dtype, optimizer_bytes_per_parameter=8,
              overhead=0)  # fmt: skip
    lengthened = []
    with mock.patch.object(memory_model, "_lengthen", lambda *a: lengthened.append(_lengthen(*a)) or lengthened[-1]):
        fast = memory_model._traced.__wrapped__(cfg, **kw)
    assert lengthened and lengthened[0] is not None, "the cut trace fell back to the whole model"
    whole = memory_model._traced.__wrapped__(cfg, whole=True, **kw)
    assert fast == whole


_lengthen = memory_model._lengthen


def test_layers_that_differ_by_place_are_traced_whole():
    """Where the two middle layers of a cut run hold different bytes, `_lengthen` refuses (the whole model is
    traced); where they agree, each later segment moves by the bytes the added copies leave."""
    timeline = [["embedding", 0, 10], ["forward 0", 10, 30], ["forward 1", 20, 40], ["forward 2", 30, 60],
                ["forward 3", 40, 70], ["loss", 50, 80], ["backward 3", 60, 90], ["backward 2", 55, 95],
                ["backward 1", 50, 90], ["backward 0", 45, 70]]  # fmt: skip
    assert memory_model._lengthen(timeline, {}, [1, 3, 1, 1]) is None
    timeline[3][2] = 50  # now the middle layers' forwards rise 20 and leave 10 (their backwards rise 40, free 5)
    out = memory_model._lengthen(timeline, {}, [1, 3, 1, 1])
    assert [row[0] for row in out] == [
        "embedding", *(f"forward {i}" for i in range(6)), "loss", *(f"backward {i}" for i in range(5, -1, -1))
    ]  # fmt: skip
    assert out[4] == ["forward 3", 40, 60]  # the third copy of forward 1
    assert out[7] == ["loss", 70, 100]  # shifted by the two added copies' 10 bytes each
    assert out[-1] == ["backward 0", 55, 80]  # and back by the 5 bytes each of their backwards frees


def test_plan_for_llama_350m_at_128k_completes():
    """The command of the README: a plan for the 336M Llama shape at 128K in 40 GiB, with its breakdown."""
    from longctx.memory.plan import plan

    p = plan(GPTConfig.preset("llama-350m"), seq_length=131072, budget="40GiB")
    assert p.memory.total <= 40 << 30
    assert p.config.recompute_granularity == "full" and p.config.recompute_skip_core_attention
