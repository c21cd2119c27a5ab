"""`integrations.transformers.memory.step_memory`: the peak of a step of a transformers model under `apply`, traced on
shape-only tensors, equals the bytes the same step holds for real on the CPU (the same attention twin and the same
no-packing rule in both), with and without PEFT's adapters, recomputation, offloading and kept attention; and its totals
add up."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from transformers import LlamaConfig  # noqa: E402

from longctx.integrations.transformers import memory  # noqa: E402
from longctx.memory.measure import LiveBytesTracker  # noqa: E402
from longctx.memory.model import CUDA_OVERHEAD_BYTES  # noqa: E402

CFG = dict(vocab_size=97, hidden_size=48, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
           num_key_value_heads=2, head_dim=12, max_position_embeddings=256, tie_word_embeddings=False)  # fmt: skip
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def _real_peak(config, S: int, dtype, lora, apply_kwargs) -> int:
    torch.manual_seed(0)
    model = memory.build(config, dtype, lora, apply_kwargs)
    x = torch.randint(0, config.vocab_size, (1, S), generator=torch.Generator().manual_seed(1))
    tracker = LiveBytesTracker()
    with memory.shape_only_step(), tracker:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        del loss
    return tracker.peak


KEEP = dict(RECOMPUTE, recompute_skip_core_attention=True)


@pytest.mark.parametrize(
    "dtype,use_lora,settings",
    [(torch.float32, False, {}), (torch.float32, False, RECOMPUTE), (torch.bfloat16, True, RECOMPUTE),
     (torch.bfloat16, True, dict(RECOMPUTE, cpu_offloading=True)), (torch.float32, False, KEEP),
     (torch.bfloat16, True, KEEP), (torch.bfloat16, True, dict(KEEP, cpu_offloading=True))],
    ids=("plain", "recompute", "lora-recompute", "lora-offload", "keep", "lora-keep", "lora-offload-keep"),
)  # fmt: skip
def test_the_trace_holds_the_bytes_of_the_real_step(dtype, use_lora, settings):
    config = LlamaConfig(**CFG)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0) if use_lora else None
    S = 96
    pred = memory.step_memory(config, seq_length=S, dtype=dtype, lora=lora, apply_kwargs=settings)
    real = _real_peak(config, S, dtype, lora, settings)
    if settings.get("cpu_offloading"):  # real CPU tensors stay (there is no other memory): the trace moves them
        checkpoints = config.num_hidden_layers * S * config.hidden_size * 2  # bf16 hidden states, one per layer
        assert pred.traced <= real <= pred.traced + checkpoints
    else:
        assert pred.traced == real
    model = memory.build(config, dtype, lora)
    n_trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert pred.trained_parameters == n_trained and pred.optimizer_states == 8 * n_trained
    assert pred.parameters == sum(p.numel() * p.element_size() for p in model.parameters())
    assert pred.total == pred.parameters + pred.optimizer_states + pred.traced + CUDA_OVERHEAD_BYTES
    if use_lora:
        assert n_trained < sum(p.numel() for p in model.parameters()) / 4  # the adapters only


def test_kept_attention_is_held_from_the_forward_to_the_recomputation():
    """recompute_skip_core_attention: at the end of the forward the step holds, beyond full recomputation, every
    layer's kept output (bf16 under autocast) and float32 lse, (B, Hq, S) each; after the backward nothing."""
    config = LlamaConfig(**CFG)
    B, S = 2, 96
    held = []
    for settings in (RECOMPUTE, KEEP):
        model = memory.build(config, torch.float32, None, settings)
        x = torch.randint(0, config.vocab_size, (B, S), generator=torch.Generator().manual_seed(1))
        tracker = LiveBytesTracker()
        with memory.shape_only_step(), tracker:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(input_ids=x, labels=x).loss
            forward_end = tracker.current
            loss.backward()
            del loss
        held.append((forward_end, tracker.current))
    H, D = config.num_attention_heads, config.head_dim
    assert held[1][0] - held[0][0] == config.num_hidden_layers * B * H * S * (2 * D + 4)
    assert held[1][1] == held[0][1]


def test_recomputation_and_offloading_lower_the_traced_peak():
    config = LlamaConfig(**{**CFG, "num_hidden_layers": 4})
    peaks = [memory.step_memory(config, seq_length=512, apply_kwargs=s).traced
             for s in ({}, RECOMPUTE, dict(RECOMPUTE, cpu_offloading=True))]  # fmt: skip
    assert peaks[0] > peaks[1] > peaks[2], peaks


def test_bad_lengths_are_refused():
    with pytest.raises(ValueError, match="seq_length must be a positive int"):
        memory.step_memory(LlamaConfig(**CFG), seq_length=0)


def test_the_lora_planner_twin_does_not_read_below_the_transformers_trace():
    """`longctx.plan(..., lora_rank=...)` traces a longctx GPT of the model's shape with adapter twins; PEFT casts
    each target's input to float32 (and autocast casts it back, a copy kept for A's gradient), so a twin that skips
    those copies reads low. At a Llama shape the twin stays within [1.0, 1.08] of the trace of the transformers
    model under PEFT and apply at two lengths (it fused q/k/v and gate/up where transformers does not)."""
    from transformers import LlamaConfig

    from longctx.bench.transformers import lora_config
    from longctx.memory.model import step_memory as gpt_step
    from longctx.models.gpt import GPTConfig

    full = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    small = dict(hidden_size=512, num_layers=4, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=1792)
    gpt = GPTConfig.preset("llama-8b").replace(vocab_size=4096, **small, **full)
    for S in (2048, 8192):
        hf = LlamaConfig(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                         intermediate_size=1792, vocab_size=4096, max_position_embeddings=S, rope_theta=500000.0,
                         tie_word_embeddings=False, use_cache=False)  # fmt: skip
        twin = gpt_step(gpt.replace(seq_length=S), seq_length=S, lora_rank=16).total
        traced = memory.step_memory(hf, seq_length=S, dtype=torch.bfloat16, lora=lora_config(16),
                             apply_kwargs=dict(full, fused_loss=True)).total  # fmt: skip
        assert 1.0 <= twin / traced <= 1.08, (S, twin / traced)


def test_the_host_side_and_offloaded_states_of_an_apply_step():
    """The host side of a step: the process, plus the checkpoints ``cpu_offloading`` moves there (one layer input in
    the residual stream's dtype per layer). With ``offload_params`` the GPU holds the units in flight (the root's
    weights, two layers' bf16 weights, the prefetched layer's float32 shard, the finished layer's gradients), no
    optimizer states, and the host each parameter's pinned float32 weight and gradient (rounded up to powers of two)
    and AdamW's states; the trace runs the bf16 units with each gradient dropped once made."""
    from longctx.memory.model import HOST_OVERHEAD_BYTES, host_state_bytes, units_in_flight

    config = LlamaConfig(**CFG)
    S, h, L = 96, config.hidden_size, config.num_hidden_layers
    offloaded = dict(RECOMPUTE, cpu_offloading=True)
    plain = memory.step_memory(config, seq_length=S, apply_kwargs=offloaded)
    assert plain.host == HOST_OVERHEAD_BYTES + L * S * h * 4 and not plain.offload_params  # float32 residual
    off = memory.step_memory(config, seq_length=S, apply_kwargs=dict(offloaded, offload_params=True))
    model = memory.build(config, torch.float32)
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    units = L * layer + model.model.embed_tokens.weight.numel()
    root = sum(p.numel() for p in model.parameters()) - units  # the final norm and the output projection
    assert off.offload_params and off.optimizer_states == 0
    assert off.parameters == units_in_flight(layer, root, 1, 2)
    shapes = [p.shape for p in model.parameters()]
    assert off.host == HOST_OVERHEAD_BYTES + L * S * h * 2 + host_state_bytes(shapes, 1)  # bf16 residual
    assert host_state_bytes(shapes, 1) >= 16 * sum(p.numel() for p in model.parameters())
    assert off.traced < plain.traced  # bf16 units, no gradients kept
    # the output layer, the embedding and the first layer resident: their fp32 weights, AdamW states and gradients on
    # the GPU, their states off the host
    kept = dict(offloaded, offload_params=True, offload_resident_units=3)
    res = memory.step_memory(config, seq_length=S, apply_kwargs=kept)
    n_res = root + model.model.embed_tokens.weight.numel() + layer
    assert res.parameters == off.parameters + 4 * n_res and res.optimizer_states == 8 * n_res
    assert res.traced == max(off.traced + 4 * layer, 4 * n_res)
    rest = [p.shape for n, p in model.named_parameters() if n.startswith("model.layers.") and not n.startswith(
        "model.layers.0.")]  # fmt: skip
    assert res.host == HOST_OVERHEAD_BYTES + L * S * h * 2 + host_state_bytes(rest, 1)
    with pytest.raises(ValueError, match="offload_resident_units must be from 0 to"):
        memory.step_memory(config, seq_length=S, apply_kwargs=dict(kept, offload_resident_units=L + 3))
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0)
    with pytest.raises(ValueError, match="offload_params with lora is not modelled"):
        memory.step_memory(config, seq_length=S, lora=lora, dtype=torch.bfloat16,
                           apply_kwargs=dict(offloaded, offload_params=True))  # fmt: skip
