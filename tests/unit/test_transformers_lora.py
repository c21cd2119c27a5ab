"""`integrations.transformers.apply` on a PEFT-wrapped causal LM (LoRA on q, k, v, o, gate, up, down) and with
``offload_params``: in float64 against the same model without apply (loss and every adapter gradient), the frozen
base untouched after training steps, packing and the guards."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from transformers import DataCollatorWithFlattening, LlamaConfig, LlamaForCausalLM  # noqa: E402

import longctx.integrations.transformers as lt  # noqa: E402
from longctx.memory.model import LORA_TARGETS  # noqa: E402
from tests.lora import with_lora  # noqa: E402

V = 101
TARGETS = list(LORA_TARGETS)  # q, k, v, o, gate, up, down
RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def _llama(seed: int = 0, impl: str = "longctx") -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=V, hidden_size=48, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=12, max_position_embeddings=128)  # fmt: skip
    return LlamaForCausalLM(cfg).to(torch.float64).train()


def _tokens(B: int, S: int, seed: int = 2) -> torch.Tensor:
    return torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(seed))


def _f64_loss(model, x: torch.Tensor) -> torch.Tensor:
    """The next-token loss from the logits in float64 (transformers' own loss upcasts to float32 only)."""
    logits = model(input_ids=x).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())


def _adapter_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("settings", [{}, RECOMPUTE, dict(RECOMPUTE, cpu_offloading=True)],
                         ids=("fused-loss", "recompute", "recompute-offload"))  # fmt: skip
def test_lora_through_apply_equals_plain_peft(settings):
    x = _tokens(2, 23)
    ref = with_lora(_llama())
    ref.base_model.model.set_attn_implementation("sdpa")
    ref_loss = _f64_loss(ref, x)
    ref_loss.backward()
    model = lt.apply(with_lora(_llama()), **settings)
    out = model(input_ids=x, labels=x)
    out.loss.backward()
    assert out.logits is None  # the logits-free loss
    torch.testing.assert_close(out.loss, ref_loss, rtol=1e-12, atol=0)
    got, want = _adapter_grads(model), _adapter_grads(ref)
    assert got.keys() == want.keys() and all("lora_" in n for n in got)
    assert len(got) == 2 * len(TARGETS) * 3  # A and B of every target in every layer
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-10, atol=1e-14, msg=n)
    frozen = [p for n, p in model.named_parameters() if "lora_" not in n]
    assert frozen and all(not p.requires_grad and p.grad is None for p in frozen)


def test_frozen_base_is_untouched_and_shared_by_training():
    model = lt.apply(with_lora(_llama()), **RECOMPUTE)
    base = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    before = {n: p.detach().clone() for n, p in base.items()}
    storage = {n: p.data_ptr() for n, p in base.items()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for step in range(4):
        x = _tokens(2, 17, seed=10 + step % 2)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[2] < losses[0] and losses[3] < losses[1]  # the adapters learn
    for n, p in model.named_parameters():
        if n in base:
            assert torch.equal(p, before[n]) and p.data_ptr() == storage[n], n  # untouched, never copied


def test_lora_with_packed_documents_equals_sdpa():
    docs = [_tokens(1, n, seed=20 + n)[0].tolist() for n in (9, 5, 12)]
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)([{"input_ids": d} for d in docs])
    batch = {k: v for k, v in batch.items() if k != "attention_mask"}
    ref = with_lora(_llama())
    ref.base_model.model.set_attn_implementation("sdpa")
    # SDPA finds the packed documents from position_ids only without a KV cache
    logits = ref(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    ref_loss = torch.nn.functional.cross_entropy(logits[0, :-1], batch["labels"][0, 1:], ignore_index=-100)
    ref_loss.backward()
    model = lt.apply(with_lora(_llama()), **RECOMPUTE)
    loss = model(**batch).loss
    loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=0)
    got, want = _adapter_grads(model), _adapter_grads(ref)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-8, atol=1e-12, msg=n)


def test_an_adapter_on_lm_head_refuses_the_fused_loss():
    with pytest.raises(ValueError, match="PEFT put an adapter on lm_head.*fused_loss=False"):
        lt.apply(with_lora(_llama(), targets=[*TARGETS, "lm_head"]))
    lt.apply(with_lora(_llama(), targets=[*TARGETS, "lm_head"]), fused_loss=False)  # the logits' loss is fine


def test_apply_twice_on_a_peft_model_raises():
    model = lt.apply(with_lora(_llama()))
    with pytest.raises(ValueError, match="apply was already called"):
        lt.apply(model)


def test_offload_params_through_apply_trains_like_the_plain_model():
    """The states in host memory (FSDP2 on a one-rank mesh; on the CPU in the parameters' dtype): the same losses
    as the plain model with the same AdamW."""
    from longctx.distributed.offload import host_adamw

    def losses(model, opt) -> list[float]:
        out = []
        for step in range(3):
            x = _tokens(2, 15, seed=30 + step)
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            out.append(loss.item())
        return out

    plain = lt.apply(_llama(), **RECOMPUTE)
    ref = losses(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0))
    model = lt.apply(_llama(), offload_params=True, **RECOMPUTE)
    assert hasattr(model.model.layers[0].mlp.up_proj.weight, "full_tensor")  # sharded by FSDP2
    got = losses(model, host_adamw(model, lr=1e-2, weight_decay=0.0))
    assert got == pytest.approx(ref, rel=1e-9)
    # the output layer and the embedding kept out of the offload: the same losses, the optimizer over both
    model = lt.apply(_llama(), offload_params=True, offload_resident_units=2, **RECOMPUTE)
    assert model._longctx_resident_units == 2
    got = losses(model, host_adamw(model, lr=1e-2, weight_decay=0.0, max_grad_norm=1e9, overlap=True))
    assert got == pytest.approx(ref, rel=1e-9)


def test_offload_params_guards():
    with pytest.raises(TypeError, match="offload_params must be True or False"):
        lt.apply(_llama(), offload_params="yes")
    with pytest.raises(ValueError, match="mesh is where offload_params shards the states"):
        lt.apply(_llama(), mesh=object())
    with pytest.raises(ValueError, match="offload_resident_units=2 keeps units of offloaded states on the GPU"):
        lt.apply(_llama(), offload_resident_units=2)
    with pytest.raises(TypeError, match="offload_resident_units must be an int, got '2'"):
        lt.apply(_llama(), offload_params=True, offload_resident_units="2")


# -- the planner's LoRA runs --------------------------------------------------------------------------------------


def test_lora_parameters_are_peft_counts():
    from longctx.memory.model import lora_parameters
    from longctx.models.gpt import GPTConfig

    for targets in (TARGETS, ["q_proj", "v_proj"], ["down_proj"]):
        model = with_lora(_llama(), targets=targets)
        counted = sum(p.numel() for p in model.parameters() if p.requires_grad)
        twin = GPTConfig(vocab_size=V, num_layers=3, hidden_size=48, num_attention_heads=4, num_query_groups=2,
                         kv_channels=12, ffn_hidden_size=64)  # fmt: skip
        assert lora_parameters(twin, 4, tuple(targets)) == counted, targets


def test_a_lora_plan_trains_only_the_adapters():
    from longctx.memory.model import lora_parameters
    from longctx.memory.plan import parameter_count, plan
    from longctx.models.gpt import GPTConfig

    cfg = GPTConfig.preset("llama-8b")
    p = plan(cfg, seq_length=65536, budget="78GiB", lora_rank=16)
    n, adapters = parameter_count(cfg)[0], lora_parameters(cfg, 16)
    m = p.memory
    assert m.lora and not p.offload_params
    assert m.parameters == 2 * n + 4 * adapters  # the frozen bf16 base and the float32 adapters
    assert m.gradients == 4 * adapters and m.optimizer_states == 8 * adapters
    assert "LoRA rank 16" in p.describe() and m.total <= 78 << 30
    full = plan(cfg, seq_length=65536, budget="78GiB", host_budget="400GiB")  # the same model trained whole
    assert full.offload_params  # its states do not fit the GPU; the adapters' do


def test_lora_settings_are_checked():
    from longctx.memory.plan import plan
    from longctx.models.gpt import GPTConfig

    cfg = GPTConfig.preset("llama-8b")
    with pytest.raises(ValueError, match="lora_rank must be a positive int"):
        plan(cfg, seq_length=4096, budget="78GiB", lora_rank=0)
    with pytest.raises(ValueError, match=r"lora_targets must be some of .*got \['wq'\]"):
        plan(cfg, seq_length=4096, budget="78GiB", lora_rank=8, lora_targets=("wq",))
    with pytest.raises(ValueError, match="offload_params with lora_rank is not planned"):
        plan(cfg, seq_length=4096, budget="78GiB", lora_rank=8, offload_params=True)


def test_plan_cli_plans_a_lora_run(capsys):
    from longctx.memory.plan import main

    assert main(["--preset", "llama-8b", "--seq-length", "131072", "--budget", "78GiB", "--lora-rank", "16",
                 "--lora-targets", "q_proj,k_proj,v_proj,o_proj"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "LoRA rank 16 on q_proj, k_proj, v_proj, o_proj" in out and "frozen bf16 base, fp32 adapters" in out


@pytest.mark.parametrize("lora", [False, True])
def test_sequence_chunks_keep_loss_and_gradients(lora):
    """``sequence_chunk_size``: each layer's MLP over chunks of tokens, recomputed in the backward: the same loss
    and gradients (float64) as the whole MLP, and the MLP runs per chunk."""
    x = _tokens(2, 23)
    settings = dict(RECOMPUTE)
    ref_model = lt.apply(with_lora(_llama()) if lora else _llama(), **settings)
    ref = ref_model(input_ids=x, labels=x).loss
    ref.backward()
    model = lt.apply(with_lora(_llama()) if lora else _llama(), sequence_chunk_size=5, **settings)
    base = model.get_base_model() if lora else model
    seen = []
    base.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, a, out: seen.append(out.shape[1]))
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=0)
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    want = {n: p.grad for n, p in ref_model.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-10, atol=1e-13, msg=n)
    assert 5 in seen and 23 not in seen  # chunks of 5 tokens (and the last of 3), never the whole row


def test_sequence_chunk_size_is_checked():
    with pytest.raises(ValueError, match="sequence_chunk_size must be a positive int or None, got 0"):
        lt.apply(_llama(), sequence_chunk_size=0)
