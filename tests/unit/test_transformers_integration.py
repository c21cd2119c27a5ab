"""longctx.integrations.transformers: tiny random models of the Llama family against attn_implementation="sdpa".

Every comparison runs one model (one set of weights) twice, switching only the attention implementation, in
float32 (tolerance: float32 rounding of differently ordered sums) and under bf16 autocast (error against the
float32 result at most twice SDPA's, plus a floor).
"""

from __future__ import annotations

import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    DataCollatorWithFlattening,
    Gemma2Config,
    GemmaConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)
from transformers.masking_utils import causal_mask_function, chunked_causal_mask_function, or_masks  # noqa: E402

import longctx.integrations.transformers as lt  # noqa: E402

V = 101
_SMALL = dict(
    vocab_size=V,
    hidden_size=48,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=12,
    max_position_embeddings=128,
)


def _config(family: str):
    if family == "llama":
        return LlamaConfig(**_SMALL)
    if family == "mistral":  # a window shorter than the sequences
        return MistralConfig(**_SMALL, sliding_window=7)
    if family == "qwen2":  # sliding layers after the first (max_window_layers): a hybrid of both masks
        return Qwen2Config(**_SMALL, use_sliding_window=True, sliding_window=6, max_window_layers=1)
    if family == "qwen3":  # q/k norms, MQA
        return Qwen3Config(**{**_SMALL, "num_key_value_heads": 1})
    if family == "gemma":
        return GemmaConfig(**_SMALL)
    if family == "gemma2":  # its own scaling (query_pre_attn_scalar), alternating sliding/full layers
        return Gemma2Config(
            **_SMALL, sliding_window=5, query_pre_attn_scalar=20, attn_logit_softcapping=None,
            final_logit_softcapping=None,
        )  # fmt: skip
    raise AssertionError(family)


FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2")


def _model(family: str, impl: str = "longctx", seed: int = 0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(family), attn_implementation=impl)
    return model.float()


def _run(model, impl: str, batch: dict, autocast: bool = False) -> tuple[torch.Tensor, torch.Tensor, dict]:
    model.set_attn_implementation(impl)
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(**batch)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach().float(), out.loss.detach(), grads


def _tokens(B: int, S: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(seed))


def _assert_close(got: dict | torch.Tensor, ref: dict | torch.Tensor, rtol: float = 2e-5, atol: float = 2e-6) -> None:
    if isinstance(ref, dict):
        assert got.keys() == ref.keys()
        for n in ref:
            torch.testing.assert_close(got[n], ref[n], rtol=rtol, atol=atol, msg=lambda m, n=n: f"{n}: {m}")
    else:
        torch.testing.assert_close(got, ref, rtol=rtol, atol=atol)


# -- attention against SDPA ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_grads_equal_sdpa(family):
    model = _model(family)
    x = _tokens(2, 29)
    batch = dict(input_ids=x, labels=x)
    ref = _run(model, "sdpa", batch)
    got = _run(model, "longctx", batch)
    _assert_close(got[0], ref[0])
    _assert_close(got[1], ref[1])
    _assert_close(got[2], ref[2])


@pytest.mark.parametrize("family", ("llama", "mistral", "gemma2"))
def test_right_padding_equals_sdpa_on_real_tokens(family):
    model = _model(family)
    x = _tokens(3, 23, seed=2)
    mask = torch.ones_like(x)
    mask[0, 15:] = 0
    mask[2, 4:] = 0
    labels = x.masked_fill(mask == 0, -100)
    batch = dict(input_ids=x, attention_mask=mask, labels=labels)
    ref = _run(model, "sdpa", batch)
    got = _run(model, "longctx", batch)
    real = mask.bool()
    _assert_close(got[0][real], ref[0][real])
    _assert_close(got[1], ref[1])
    _assert_close(got[2], ref[2])


def test_padded_keys_are_never_attended():
    """What sits at the padded positions cannot change the real tokens' logits."""
    model = _model("llama").eval()
    model.set_attn_implementation("longctx")
    x = _tokens(2, 17, seed=3)
    mask = torch.ones_like(x)
    mask[1, 9:] = 0
    y = x.clone()
    y[1, 9:] = (y[1, 9:] + 7) % V
    with torch.no_grad():
        a = model(input_ids=x, attention_mask=mask).logits
        b = model(input_ids=y, attention_mask=mask).logits
    assert torch.equal(a[mask.bool()], b[mask.bool()])


def _packed(lengths: list[int], flash_kwargs: bool, seed: int = 4) -> dict:
    g = torch.Generator().manual_seed(seed)
    feats = [{"input_ids": torch.randint(0, V, (n,), generator=g).tolist()} for n in lengths]
    return dict(DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)(feats))


@pytest.mark.parametrize("flash_kwargs", (True, False), ids=("cu_seq_lens", "position_ids"))
@pytest.mark.parametrize("family", ("llama", "mistral", "qwen2"))
def test_packed_flattening_collator_equals_sdpa(family, flash_kwargs):
    model = _model(family)
    # use_cache=False: transformers' SDPA mask finds the packed documents only without a KV cache
    batch = {**_packed([5, 13, 1, 9], flash_kwargs), "use_cache": False}
    ref = _run(model, "sdpa", batch)
    got = _run(model, "longctx", batch)
    _assert_close(got[0], ref[0])
    _assert_close(got[1], ref[1])
    _assert_close(got[2], ref[2])


@pytest.mark.parametrize("flash_kwargs", (True, False), ids=("cu_seq_lens", "position_ids"))
def test_packed_documents_do_not_see_each_other(flash_kwargs):
    """The packed row's logits equal each document run alone (with the KV cache on, as by default)."""
    model = _model("mistral").eval()
    model.set_attn_implementation("longctx")
    lengths = [6, 11, 4]
    batch = _packed(lengths, flash_kwargs=flash_kwargs)
    with torch.no_grad():
        packed = model(**{k: v for k, v in batch.items() if k != "labels"}).logits[0]
        start = 0
        for n in lengths:
            alone = model(input_ids=batch["input_ids"][:, start : start + n]).logits[0]
            _assert_close(packed[start : start + n], alone)
            start += n


@pytest.mark.parametrize("family", ("llama", "qwen2"))
def test_bf16_autocast_as_accurate_as_sdpa(family):
    model = _model(family)
    x = _tokens(2, 25, seed=5)
    batch = dict(input_ids=x, labels=x)
    exact = _run(model, "sdpa", batch)
    ref = _run(model, "sdpa", batch, autocast=True)
    got = _run(model, "longctx", batch, autocast=True)

    def err(a, b):
        return (a - b).abs().max().item()

    assert err(got[0], exact[0]) <= 2 * err(ref[0], exact[0]) + 1e-2
    for n in exact[2]:
        scale = exact[2][n].abs().max().item()
        assert err(got[2][n], exact[2][n]) <= 2 * err(ref[2][n], exact[2][n]) + 1e-2 * scale, n


def test_generate_with_kv_cache_matches_sdpa():
    model = _model("mistral").eval()
    x = _tokens(1, 9, seed=6)
    outs = {}
    for impl in ("sdpa", "longctx"):
        model.set_attn_implementation(impl)
        outs[impl] = model.generate(x, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(outs["longctx"], outs["sdpa"])


# -- apply ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "recompute",
    [
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
        dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2),
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=3, cpu_offloading=True),
        dict(recompute_granularity="selective"),
    ],
    ids=("uniform1", "uniform2", "block2", "offload", "selective"),
)
def test_apply_recompute_keeps_gradients_bitwise(recompute):
    x = _tokens(2, 21, seed=7)
    batch = dict(input_ids=x, labels=x)
    plain = _run(lt.apply(_model("llama"), fused_loss=False), "longctx", batch)  # the same fused norms and gates
    model = lt.apply(_model("llama"), fused_loss=False, **recompute)
    got = _run(model, "longctx", batch)
    assert torch.equal(got[1], plain[1])
    for n in plain[2]:
        assert torch.equal(got[2][n], plain[2][n]), n


@pytest.mark.parametrize("family", FAMILIES)
def test_apply_fuses_llama_form_norms_and_gates_and_equals_transformers(family):
    """Llama-form RMSNorms and SiLU gates go through longctx.ops.pointwise; Gemma's (1 + weight) norms and GELU gates
    keep transformers' forward. Either way logits and gradients equal transformers' own (float32: the fused norm's
    forward is transformers' to the bit, its backward a closed form instead of autograd's steps)."""
    apply_module = sys.modules["longctx.integrations.transformers.apply"]
    x = _tokens(2, 19, seed=3)
    batch = dict(input_ids=x, labels=x)
    ref = _run(_model(family), "longctx", batch)
    model = lt.apply(_model(family), fused_loss=False)
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    mlps = [m for m in model.modules() if type(m).__name__.endswith("MLP")]
    fused = family not in ("gemma", "gemma2")
    layer_norms = [m for layer in model.model.layers for m in layer.modules() if m in norms]
    assert layer_norms and all(
        (getattr(m.forward, "__func__", None) is apply_module._norm_forward) == fused for m in layer_norms
    )
    assert mlps and all((getattr(m.forward, "__func__", None) is apply_module._mlp_forward) == fused for m in mlps)
    got = _run(model, "longctx", batch)
    assert torch.equal(got[0], ref[0])
    _assert_close(got[2], ref[2], rtol=1e-4, atol=1e-6)


def test_apply_recompute_runs_each_layer_once_more():
    """Full recomputation costs one extra forward of every recomputed layer (counted by calls)."""
    model = lt.apply(_model("llama"), recompute_granularity="full", recompute_method="uniform", recompute_num_layers=3,
                     fused_loss=False)  # fmt: skip
    calls = []
    for layer in model.model.layers:
        layer.mlp.register_forward_hook(lambda *a: calls.append(1))
    x = _tokens(1, 11)
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):  # replay whole layers, not up to the last saved
        model(input_ids=x, labels=x).loss.backward()
    assert len(calls) == 2 * 3
    calls.clear()
    model.eval()
    with torch.no_grad():
        model(input_ids=x)
    assert len(calls) == 3


@pytest.mark.parametrize("family", ("llama", "qwen3", "gemma"))
def test_apply_fused_loss_equals_logits_loss(family):
    x = _tokens(2, 19, seed=8)
    labels = x.clone()
    labels[0, :5] = -100
    batch = dict(input_ids=x, labels=labels)
    plain = _run(_model(family), "longctx", batch)
    model = lt.apply(_model(family), recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    model.zero_grad()
    out = model(**batch)
    assert out.logits is None
    out.loss.backward()
    _assert_close(out.loss.detach(), plain[1])
    _assert_close({n: p.grad for n, p in model.named_parameters()}, plain[2])
    # the Trainer's num_items_in_batch: the sum over that count, as ForCausalLMLoss
    n_items = torch.tensor(50)
    ref = _model(family)(**batch, num_items_in_batch=n_items).loss
    _assert_close(model(**batch, num_items_in_batch=n_items).loss.detach(), ref.detach())


def test_apply_without_labels_returns_logits():
    model = lt.apply(_model("llama"))
    x = _tokens(1, 8)
    ref = _model("llama")
    ref.set_attn_implementation("longctx")
    _assert_close(model(input_ids=x).logits, ref(input_ids=x).logits)


def _trainer_dataset(n: int = 16) -> list[dict]:
    g = torch.Generator().manual_seed(9)
    return [{"input_ids": torch.randint(0, V, (int(torch.randint(4, 20, (1,), generator=g)),), generator=g).tolist()}
            for _ in range(n)]  # fmt: skip


def test_trainer_runs_a_few_steps_with_apply(tmp_path):
    from transformers import Trainer, TrainingArguments

    model = lt.apply(_model("llama"), recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4, learning_rate=1e-2, logging_steps=1,
        report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    trainer = Trainer(
        model=model, args=args, train_dataset=_trainer_dataset(),
        data_collator=DataCollatorWithFlattening(return_flash_attn_kwargs=True),
    )  # fmt: skip
    result = trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    assert result.global_step == 4
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())


# -- what it does not serve: clear errors ---------------------------------------------------------------------------


def test_output_attentions_raises():
    model = _model("llama")
    with pytest.raises(ValueError, match="output_attentions"):
        model(input_ids=_tokens(1, 6), output_attentions=True)


def test_attention_dropout_raises_in_training():
    model = AutoModelForCausalLM.from_config(
        LlamaConfig(**_SMALL, attention_dropout=0.1), attn_implementation="longctx"
    )
    model.train()
    with pytest.raises(ValueError, match="dropout"):
        model(input_ids=_tokens(1, 6))
    model.eval()
    model(input_ids=_tokens(1, 6))  # no dropout in eval: served


def test_custom_4d_mask_raises():
    model = _model("llama")
    mask4 = torch.ones(1, 1, 6, 6, dtype=torch.bool).tril()
    with pytest.raises(TypeError, match="4-D"):
        model(input_ids=_tokens(1, 6), attention_mask=mask4)


def test_unimplemented_mask_rules_raise():
    def image_block(b, h, q, kv):
        return (q < 3) & (kv < 3)

    with pytest.raises(ValueError, match="does not implement the mask rule"):
        lt.longctx_mask(1, 6, 6, mask_function=or_masks(causal_mask_function, image_block))
    with pytest.raises(ValueError, match="chunked"):
        lt.longctx_mask(1, 6, 6, mask_function=chunked_causal_mask_function(4, torch.zeros(1, dtype=torch.long)))


def test_apply_rejects_what_it_cannot_do():
    with pytest.raises(ValueError, match="recompute_method"):
        lt.apply(_model("llama"), recompute_granularity="full")
    with pytest.raises(ValueError, match="recompute_granularity='full'"):
        lt.apply(_model("llama"), cpu_offloading=True)
    gemma2 = _model("gemma2")
    gemma2.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        lt.apply(gemma2)
    lt.apply(gemma2, fused_loss=False)  # without the fused loss it is served
    gc = _model("llama")
    gc.gradient_checkpointing_enable()
    with pytest.raises(ValueError, match="gradient checkpointing"):
        lt.apply(gc, recompute_granularity="full", recompute_method="block", recompute_num_layers=1)
    done = lt.apply(_model("llama"))
    with pytest.raises(ValueError, match="already"):
        lt.apply(done)


def test_hidden_states_inside_a_recomputed_chunk_raise():
    model = lt.apply(_model("llama"), recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2)
    x = _tokens(1, 7)
    with pytest.raises(ValueError, match="output_hidden_states"):
        model(input_ids=x, labels=x, output_hidden_states=True)


def test_from_pretrained_takes_the_implementation(tmp_path):
    _model("qwen2").save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="longctx")
    assert model.config._attn_implementation == "longctx"
    x = _tokens(1, 9)
    ref = _model("qwen2")
    ref.set_attn_implementation("sdpa")
    _assert_close(model(input_ids=x).logits, ref(input_ids=x).logits)


# -- compile_ahead: the attention description handed to longctx.warmup ---------------------------------------------


def test_compile_ahead_reads_the_attention_from_the_config():
    shape = lt._attention_shape(LlamaConfig(**_SMALL), packed=False)
    assert shape == dict(head_dim=12, n_heads=4, n_kv_heads=2, masks=["causal"], window=None, softcap=0.0)
    # every layer slides (transformers' window of 64 tokens is longctx's left window 63)
    shape = lt._attention_shape(MistralConfig(**_SMALL, sliding_window=64), packed=True)
    assert shape["masks"] == ["documents_window"] and shape["window"] == 63
    # alternating layers and the logit softcap (Gemma 2)
    shape = lt._attention_shape(Gemma2Config(**_SMALL, sliding_window=32, attn_logit_softcapping=50.0), packed=False)
    assert shape["masks"] == ["causal", "window"] and shape["window"] == 31 and shape["softcap"] == 50.0
    # Qwen2 with the window off: plain causal
    assert lt._attention_shape(Qwen2Config(**_SMALL), packed=True)["masks"] == ["documents"]
    # head dim from the width where the config has none
    cfg = LlamaConfig(**{**_SMALL, "head_dim": None})
    assert lt._attention_shape(cfg, packed=False)["head_dim"] == 12


def test_compile_ahead_needs_a_model_on_the_gpu():
    model = AutoModelForCausalLM.from_config(LlamaConfig(**_SMALL))
    with pytest.raises(ValueError, match="CUDA device"):
        lt.compile_ahead(model, 1024)
    with pytest.raises(TypeError, match="packed"):
        lt.compile_ahead(model, 1024, packed="yes")


@pytest.mark.parametrize("trains_norms", [True, False], ids=["full", "frozen-norms"])
def test_compile_ahead_records_the_fused_norm_and_mlp_kernels(recorded_pointwise_launches, trains_norms):
    """`compile_ahead`'s position-wise part: with the launchers' path taken (as on a GPU), the first layer's fused
    norms and MLP run forward and backward on a stand-in of 256 tokens, recording RMSNorm and SwiGLU both ways; the
    norms' weight gradient only where they train."""
    from longctx.integrations.transformers.warmup import _compile_pointwise

    model = _model("llama")
    lt.apply(model)
    if not trains_norms:
        for name, p in model.named_parameters():
            p.requires_grad_("norm" not in name)
    recorded = recorded_pointwise_launches
    report = _compile_pointwise(model, 4096, torch.bfloat16, torch.device("cpu"), None)
    names = {k.__name__ for k, *_ in recorded}
    assert names == {"rmsnorm_fwd_kernel", "rmsnorm_bwd_kernel", "swiglu_fwd_kernel", "swiglu_bwd_kernel"}
    assert len(report) == len(recorded)
    rows = {args[0].shape[0] for k, _, args, _ in recorded if k.__name__ == "rmsnorm_fwd_kernel"}
    assert rows == {256}
    need_dw = {kw["NEED_DW"] for k, _, _, kw in recorded if k.__name__ == "rmsnorm_bwd_kernel"}
    assert need_dw == {trains_norms}
    assert all(p.grad is None for p in model.parameters())
    # a model apply did not touch has nothing fused: nothing to record
    recorded.clear()
    assert _compile_pointwise(_model("llama"), 4096, torch.bfloat16, torch.device("cpu"), None) == []


def test_trainer_with_offloaded_states_and_the_overlapped_host_step(tmp_path):
    """transformers' Trainer over `apply(model, offload_params=True)` with `host_adamw(..., max_grad_norm=,
    overlap=True)` as its optimizer (Trainer's own clipping off): its losses and final weights are those of the
    same run with the host step taken in place, to the bit, and an evaluation mid-run reads stepped weights (its
    forward waits for the step)."""
    from transformers import Trainer, TrainingArguments

    from longctx.distributed.offload import host_adamw

    def run(overlap: bool, out: str):
        torch.manual_seed(0)
        model = lt.apply(_model("llama"), offload_params=True)
        opt = host_adamw(model, lr=1e-2, max_grad_norm=0.1, overlap=overlap)
        args = TrainingArguments(
            output_dir=str(tmp_path / out), max_steps=4, per_device_train_batch_size=4, learning_rate=1e-2,
            logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
            dataloader_num_workers=0, max_grad_norm=0.0, eval_strategy="steps", eval_steps=2,
        )  # fmt: skip
        data = _trainer_dataset()
        trainer = Trainer(model=model, args=args, train_dataset=data, eval_dataset=data[:4], optimizers=(opt, None),
                          data_collator=DataCollatorWithFlattening(return_flash_attn_kwargs=True))  # fmt: skip
        trainer.train()
        opt.wait()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        losses += [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
        assert opt.last_grad_norm is not None
        return losses, [p.full_tensor() for g in opt.param_groups for p in g["params"]]  # the sharded weights

    inline_losses, inline = run(False, "inline")
    losses, weights = run(True, "overlap")
    assert len(losses) == 6 and losses == inline_losses
    assert all(torch.equal(a, b) for a, b in zip(weights, inline, strict=True))


def _offloaded_trainer_losses(out_dir, lora: bool, resume: str | None = None) -> list[float]:
    """transformers' Trainer on an offloaded `apply` model (under PEFT's LoRA with ``lora``) and an overlapped
    `host_adamw`: 4 steps, a checkpoint every 2, from ``resume`` if given; the logged losses."""
    from transformers import Trainer, TrainingArguments

    from longctx.distributed.offload import host_adamw
    from tests.lora import with_lora

    torch.manual_seed(0)
    model = lt.apply(with_lora(_model("llama")) if lora else _model("llama"), offload_params=True)
    opt = host_adamw(model, lr=1e-2, max_grad_norm=0.1, overlap=True)
    args = TrainingArguments(
        output_dir=str(out_dir), max_steps=4, per_device_train_batch_size=4, learning_rate=1e-2, logging_steps=1,
        report_to=[], save_strategy="steps", save_steps=2, use_cpu=True, disable_tqdm=True, dataloader_num_workers=0,
        max_grad_norm=0.0,
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=_trainer_dataset(), optimizers=(opt, None),
                      data_collator=DataCollatorWithFlattening(return_flash_attn_kwargs=True))  # fmt: skip
    trainer.train(resume_from_checkpoint=resume)
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_trainer_checkpoints_and_resumes_an_offloaded_model(tmp_path):
    """transformers' Trainer saves an offloaded model's checkpoints (`save_pretrained` writes whole tensors, not the
    FSDP2 shards safetensors cannot hold) and resumes from one into the shards (a load_state_dict pre-hook), the
    overlapped host step's states with it: the resumed run's losses are the uninterrupted run's."""
    whole = _offloaded_trainer_losses(tmp_path / "run", lora=False)
    assert (tmp_path / "run" / "checkpoint-2" / "model.safetensors").is_file()
    resumed = _offloaded_trainer_losses(tmp_path / "run", lora=False, resume=str(tmp_path / "run" / "checkpoint-2"))
    assert len(whole) == 4 and resumed == whole  # the first two from the checkpoint's log, the last two trained again


def test_trainer_checkpoints_and_resumes_lora_adapters_of_an_offloaded_model(tmp_path):
    """A LoRA run under PEFT with the states offloaded: transformers' Trainer saves the adapters at each checkpoint
    (`save_pretrained` of the PEFT model writes whole tensors; with FSDP2's shards safetensors failed at the first
    save and the run was lost) and resumes from one into the shards, to the uninterrupted run's losses."""
    pytest.importorskip("peft")
    whole = _offloaded_trainer_losses(tmp_path / "run", lora=True)
    assert (tmp_path / "run" / "checkpoint-2" / "adapter_model.safetensors").is_file()
    resumed = _offloaded_trainer_losses(tmp_path / "run", lora=True, resume=str(tmp_path / "run" / "checkpoint-2"))
    assert len(whole) == 4 and resumed == whole


def test_save_pretrained_of_states_offloaded_over_ranks_names_the_way():
    """Over several ranks transformers' Trainer saves on one rank only, where gathering the shards would wait for
    the others: `save_pretrained` raises at once, naming what to do."""
    import types

    from longctx.integrations.transformers.apply import _patch_save_pretrained

    model = lt.apply(_model("llama"), offload_params=True)
    _patch_save_pretrained(model, model, types.SimpleNamespace(size=lambda: 2))  # as if sharded over two ranks
    with pytest.raises(ValueError, match="offloaded over 2 ranks.*save_sharded_state"):
        model.save_pretrained("unused")
