"""GPU lane of the transformers integration and of autocast: bf16 on CUDA against SDPA and a float32 reference.

Every check measures longctx's error and SDPA's error against the same float32 run (SDPA, fp32 weights, no
autocast) and asks ``err(longctx) <= 2 * err(SDPA) + floor``: attention that follows autocast, and a tiny Llama /
Mistral / Qwen2 under bf16 autocast (plain, right-padded, packed with the flattening collator), with `apply` (and its
kept attention, ``recompute_skip_core_attention``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import longctx
from longctx import tuning

transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    DataCollatorWithFlattening,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
)

import longctx.integrations.transformers as lt  # noqa: E402

V = 1000


@pytest.fixture(autouse=True)
def _no_autotune():
    with tuning.override(autotune=False):
        yield


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


# -- attention follows autocast ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_attention_follows_autocast_on_cuda(dtype):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 1025, 128, generator=g).cuda()  # float32 q, k (after RoPE)
    k = torch.randn(2, 2, 1025, 128, generator=g).cuda()
    v = torch.randn(2, 2, 1025, 128, generator=g).cuda().to(dtype)
    with pytest.raises(TypeError, match="share one dtype"):
        longctx.attention(q, k, v, causal=True)
    with torch.autocast("cuda", dtype=dtype):
        out = longctx.attention(q, k, v, causal=True)
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True, enable_gqa=True)
    assert out.dtype == ref.dtype == dtype
    assert _err(out, exact) <= 2 * _err(ref, exact) + 1e-3
    cast = longctx.attention(q.to(dtype), k.to(dtype), v, causal=True)
    assert torch.equal(out, cast)


def test_varlen_follows_autocast_on_cuda():
    g = torch.Generator().manual_seed(1)
    cu = torch.tensor([0, 300, 1000, 1333], dtype=torch.int32, device="cuda")
    q = torch.randn(1333, 8, 64, generator=g).cuda()
    k = torch.randn(1333, 2, 64, generator=g).cuda()
    v = torch.randn(1333, 2, 64, generator=g).cuda().bfloat16()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = longctx.flash_attn_varlen_func(q, k, v, cu, cu, 700, 700, causal=True)
    ref = longctx.flash_attn_varlen_func(q.bfloat16(), k.bfloat16(), v, cu, cu, 700, 700, causal=True)
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref)


# -- models ---------------------------------------------------------------------------------------------------------

_SHAPE = dict(
    vocab_size=V, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
    num_key_value_heads=2, max_position_embeddings=4096,
)  # fmt: skip


def _model(family: str):
    cfg = {
        "llama": lambda: LlamaConfig(**_SHAPE),
        "mistral": lambda: MistralConfig(**_SHAPE, sliding_window=200),
        "qwen2": lambda: Qwen2Config(**_SHAPE, use_sliding_window=True, sliding_window=150, max_window_layers=1),
    }[family]()
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").cuda().float()


def _run(model, impl: str, batch: dict, autocast: bool) -> tuple[torch.Tensor, dict]:
    model.set_attn_implementation(impl)
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        out = model(**batch)
    out.loss.backward()
    logits = out.logits.detach().float() if out.logits is not None else None
    return logits, {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


def _check(model, batch: dict, *, real: torch.Tensor | None = None, patched=None) -> None:
    exact = _run(model, "sdpa", batch, autocast=False)
    ref = _run(model, "sdpa", batch, autocast=True)
    got = _run(patched or model, "longctx", batch, autocast=True)
    sel = (lambda t: t[real]) if real is not None else (lambda t: t)
    if got[0] is not None:
        assert _err(sel(got[0]), sel(exact[0])) <= 2 * _err(sel(ref[0]), sel(exact[0])) + 1e-2
    for n in exact[1]:
        scale = exact[1][n].abs().max().item()
        assert _err(got[1][n], exact[1][n]) <= 2 * _err(ref[1][n], exact[1][n]) + 5e-3 * scale, n


def _tokens(B: int, S: int, seed: int = 2) -> torch.Tensor:
    return torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(seed)).cuda()


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_model_bf16_autocast_against_sdpa(family):
    x = _tokens(2, 1000)
    _check(_model(family), dict(input_ids=x, labels=x))


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_right_padded_bf16_against_sdpa(family):
    x = _tokens(3, 700, seed=3)
    mask = torch.ones_like(x)
    mask[0, 500:] = 0
    mask[2, 37:] = 0
    batch = dict(input_ids=x, attention_mask=mask, labels=x.masked_fill(mask == 0, -100))
    _check(_model(family), batch, real=mask.bool())


@pytest.mark.parametrize("flash_kwargs", [True, False], ids=["cu_seq_lens", "position_ids"])
def test_packed_bf16_against_sdpa(flash_kwargs):
    g = torch.Generator().manual_seed(4)
    feats = [{"input_ids": torch.randint(0, V, (n,), generator=g).tolist()} for n in (300, 1, 517, 129, 800)]
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)(feats)
    batch = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    _check(_model("mistral"), {**batch, "use_cache": False})


@pytest.mark.parametrize("applied", [False, True], ids=["attention", "apply"])
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_compile_ahead_leaves_nothing_to_compile(family, packed, applied):
    """After `compile_ahead`, a training step of the model (rows of one length, or packed documents) compiles no
    kernel: Triton's jit_cache_hook sees no miss. With `apply`, its fused norms and MLPs too."""
    knobs = getattr(pytest.importorskip("triton"), "knobs", None)
    if knobs is None or not hasattr(knobs.runtime, "jit_cache_hook"):
        pytest.skip("this Triton has no jit_cache_hook")
    model = _model(family)
    model.set_attn_implementation("longctx")
    if applied:
        lt.apply(model)
    report = lt.compile_ahead(model, 2048, packed=packed)
    assert report.failed == []
    if packed:
        g = torch.Generator().manual_seed(4)
        feats = [{"input_ids": torch.randint(0, V, (n,), generator=g).tolist()} for n in (300, 1, 517, 129, 800)]
        batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(feats)
        batch = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        batch["use_cache"] = False
    else:
        x = _tokens(2, 1000)
        batch = dict(input_ids=x, labels=x)
    misses = []
    old = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = lambda *a, **k: misses.append(k.get("fn"))
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(**batch)
        out.loss.backward()
        torch.cuda.synchronize()
    finally:
        knobs.runtime.jit_cache_hook = old
    assert misses == []


def test_apply_bf16_against_sdpa():
    """apply (full recompute, fused loss): gradients as accurate as SDPA's under bf16 autocast."""
    x = _tokens(1, 2048, seed=5)
    model = _model("llama")
    patched = _model("llama")
    lt.apply(patched, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    _check(model, dict(input_ids=x, labels=x), patched=patched)


def test_apply_offloading_gradients_bitwise_equal_recompute():
    x = _tokens(1, 1024, seed=6)
    grads = []
    for offload in (False, True):
        model = lt.apply(
            _model("llama"), recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
            cpu_offloading=offload,
        )  # fmt: skip
        grads.append(_run(model, "longctx", dict(input_ids=x, labels=x), autocast=True)[1])
    for n in grads[0]:
        assert torch.equal(grads[0][n], grads[1][n]), n


@pytest.mark.parametrize("offload", [False, True], ids=["keep", "offload-keep"])
def test_apply_keep_attention_bf16_against_apply_without_it(offload):
    """recompute_skip_core_attention under bf16 autocast: each layer's attention ran forward once (longctx's Triton
    launchers, counted), and the gradients are as close to apply's without the option, and to the float32 run, as
    SDPA's bf16 gradients are to the float32 run (plus a floor)."""
    import dataclasses
    from unittest import mock

    import longctx.layers.attention as attention_layer
    from longctx.launchers.select import resolve_launchers

    x = _tokens(1, 2048, seed=7)
    batch = dict(input_ids=x, labels=x)
    settings = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
                    cpu_offloading=offload)  # fmt: skip
    model = _model("llama")
    exact = _run(model, "sdpa", batch, autocast=False)[1]
    ref = _run(model, "sdpa", batch, autocast=True)[1]
    plain = _run(lt.apply(_model("llama"), **settings), "longctx", batch, autocast=True)[1]
    used = []

    def launchers(*a, **k):
        inner = resolve_launchers(*a, **k)

        def forward(*a, **k):
            used.append(inner.name)
            return inner.forward(*a, **k)

        return dataclasses.replace(inner, forward=forward)

    kept_model = lt.apply(_model("llama"), recompute_skip_core_attention=True, **settings)
    with mock.patch.object(attention_layer, "resolve_launchers", launchers):
        kept = _run(kept_model, "longctx", batch, autocast=True)[1]
    assert used == ["triton"] * _SHAPE["num_hidden_layers"]
    assert kept.keys() == exact.keys()
    for n in exact:
        bound = 2 * _err(ref[n], exact[n]) + 5e-3 * exact[n].abs().max().item()
        assert _err(kept[n], exact[n]) <= bound, n
        assert _err(kept[n], plain[n]) <= bound, n


# -- LoRA under PEFT through apply ---------------------------------------------------------------------------------


def test_lora_through_apply_on_the_gpu():
    """A bf16 Llama under PEFT's LoRA adapters: longctx (apply with recomputation and the fused loss) against SDPA,
    the loss and every adapter gradient measured against a float32 SDPA run: within twice SDPA's own bf16 error
    plus a floor; the frozen base gets no gradient."""
    pytest.importorskip("peft")
    from tests.lora import with_lora

    cfg = LlamaConfig(vocab_size=V, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=4096)  # fmt: skip

    def build(impl: str, dtype: torch.dtype):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=impl, dtype=dtype).cuda()
        return with_lora(model, rank=8)

    x = torch.randint(0, V, (1, 2048), generator=torch.Generator().manual_seed(2)).cuda()

    def run(model, autocast: bool):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        return loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters() if p.requires_grad}

    ref_loss, ref = run(build("sdpa", torch.float32), autocast=False)
    sdpa_loss, sdpa = run(build("sdpa", torch.bfloat16), autocast=True)
    model = lt.apply(build("longctx", torch.bfloat16), recompute_granularity="full", recompute_method="uniform",
                     recompute_num_layers=1)  # fmt: skip
    got_loss, got = run(model, autocast=True)
    assert _err(got_loss, ref_loss) <= 2 * _err(sdpa_loss, ref_loss) + 1e-2
    assert got.keys() == ref.keys() and all("lora_" in n for n in got)
    for n in ref:
        scale = ref[n].abs().max().item()
        assert _err(got[n], ref[n]) <= 2 * _err(sdpa[n], ref[n]) + 2e-2 * scale, n
    assert all(p.grad is None for n, p in model.named_parameters() if "lora_" not in n)
