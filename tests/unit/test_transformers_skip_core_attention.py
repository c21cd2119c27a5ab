"""`integrations.transformers.apply(..., recompute_skip_core_attention=True)`: each recomputed layer's attention runs
forward once and backward once (counted), with the loss and every gradient bitwise those of `apply` without the
option and float64-tight to the plain transformers model (with and without PEFT's LoRA adapters); the calls it
cannot keep exactly (packed documents, padding, a shorter sliding window, a softcap) recompute as without it; the
settings it cannot serve raise."""

from __future__ import annotations

import contextlib
import dataclasses
from unittest import mock

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from transformers import DataCollatorWithFlattening, Gemma2Config, LlamaConfig, MistralConfig  # noqa: E402

import longctx.integrations.transformers as lt  # noqa: E402
import longctx.integrations.transformers.attention as hf_attention  # noqa: E402
import longctx.layers.attention as attention_layer  # noqa: E402
from longctx.launchers.select import resolve_launchers  # noqa: E402
from tests.lora import with_lora  # noqa: E402

V, L = 101, 3
FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
_SHAPE = dict(vocab_size=V, hidden_size=48, intermediate_size=64, num_hidden_layers=L, num_attention_heads=4,
              num_key_value_heads=2, head_dim=12, max_position_embeddings=128)  # fmt: skip


def _config(family: str, **kw):
    if family == "llama":
        return LlamaConfig(**_SHAPE, **kw)
    if family == "mistral":
        return MistralConfig(**_SHAPE, **kw)
    if family == "gemma2":  # sliding, full, sliding layers
        return Gemma2Config(**_SHAPE, sliding_window=5, query_pre_attn_scalar=20, final_logit_softcapping=None,
                            **{"attn_logit_softcapping": None, **kw})  # fmt: skip
    raise AssertionError(family)


def _model(family: str = "llama", lora: bool = False, **kw):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(family, **kw), attn_implementation="longctx")
    model = model.to(torch.float64).train()
    return with_lora(model) if lora else model


def _tokens(B: int, S: int, seed: int = 2) -> torch.Tensor:
    return torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(seed))


def _step(model, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _assert_close_to(loss, got, ref_loss, ref) -> None:
    """``loss`` and the gradients ``got`` float64-tight to ``ref``'s, whose ``ref_loss`` is differentiated."""
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-12, atol=0)
    want = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-10, atol=1e-13, msg=n)


def _assert_equal(got, want) -> None:
    assert torch.equal(got[0], want[0]), (got[0], want[0])
    assert got[1].keys() == want[1].keys() and got[1]
    for n in want[1]:
        assert torch.equal(got[1][n], want[1][n]), n


@contextlib.contextmanager
def _counting():
    """Counts of attention's runs: ``attention`` (longctx.attention, forward and backward as one call, what a layer
    runs without the option), ``kept forward`` and ``kept backward`` (the launchers of the kept path)."""
    counts = {"attention": 0, "kept forward": 0, "kept backward": 0}
    plain = hf_attention.attention

    def attention(*a, **k):
        counts["attention"] += 1
        return plain(*a, **k)

    def launchers(*a, **k):
        inner = resolve_launchers(*a, **k)

        def forward(*a, **k):
            counts["kept forward"] += 1
            return inner.forward(*a, **k)

        def backward(*a, **k):
            counts["kept backward"] += 1
            return inner.backward(*a, **k)

        return dataclasses.replace(inner, forward=forward, backward=backward)

    with mock.patch.object(hf_attention, "attention", attention), \
            mock.patch.object(attention_layer, "resolve_launchers", launchers):  # fmt: skip
        yield counts


# -- the same loss and gradients -----------------------------------------------------------------------------------


@pytest.mark.parametrize("lora", [False, True], ids=("full", "lora"))
@pytest.mark.parametrize(
    "settings",
    [FULL, dict(FULL, recompute_num_layers=2), dict(FULL, recompute_method="block", recompute_num_layers=2),
     dict(FULL, cpu_offloading=True), dict(FULL, sequence_chunk_size=5)],
    ids=("uniform1", "uniform2", "block2", "offload", "chunks"),
)  # fmt: skip
def test_gradients_equal_apply_without_the_option(settings, lora):
    x = _tokens(2, 23)
    batch = dict(input_ids=x, labels=x)
    want = _step(lt.apply(_model(lora=lora), **settings), batch)
    with _counting() as counts:
        got = _step(lt.apply(_model(lora=lora), recompute_skip_core_attention=True, **settings), batch)
    _assert_equal(got, want)
    kept = L if settings["recompute_method"] == "uniform" else 2  # block: the first 2 layers are recomputed
    assert counts == {"attention": L - kept, "kept forward": kept, "kept backward": kept}
    if lora:
        assert all("lora_" in n for n in got[1])


@pytest.mark.parametrize("lora", [False, True], ids=("full", "lora"))
def test_gradients_equal_the_plain_model(lora):
    """Against transformers' own model (SDPA, the loss from the logits in float64): float64-tight."""
    x = _tokens(2, 23)
    ref = _model(lora=lora)
    (ref.base_model.model if lora else ref).set_attn_implementation("sdpa")
    logits = ref(input_ids=x).logits
    ref_loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
    ref_loss.backward()
    loss, got = _step(lt.apply(_model(lora=lora), recompute_skip_core_attention=True, **FULL),
                      dict(input_ids=x, labels=x))  # fmt: skip
    _assert_close_to(loss, got, ref_loss, ref)


# -- attention runs forward once ----------------------------------------------------------------------------------


def test_attention_runs_forward_once_per_layer_and_step():
    """With the option each layer's attention runs one forward (kept) and one backward (from what was kept) a
    step; without it, longctx.attention runs twice a layer (the forward, and again in the recomputation)."""
    x = _tokens(1, 19)
    batch = dict(input_ids=x, labels=x)
    kept = lt.apply(_model(), recompute_skip_core_attention=True, **FULL)
    plain = lt.apply(_model(), **FULL)
    for step in (1, 2):
        with _counting() as counts:
            _step(kept, batch)
        assert counts == {"attention": 0, "kept forward": L, "kept backward": L}, step
        with _counting() as counts:
            _step(plain, batch)
        assert counts == {"attention": 2 * L, "kept forward": 0, "kept backward": 0}, step
    with _counting() as counts, torch.no_grad():  # no recomputation, nothing kept
        kept(input_ids=x)
    assert counts == {"attention": L, "kept forward": 0, "kept backward": 0}


def test_autocast_keeps_what_longctx_attention_computes():
    """Under bf16 autocast (float32 weights) the kept path casts q, k, v as longctx.attention does: the same loss
    and gradients as without the option (both run the tiled kernels on the CPU)."""
    x = _tokens(2, 21, seed=3)
    out = []
    for keep in (False, True):
        model = lt.apply(_model().float(), recompute_skip_core_attention=keep, **FULL)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        out.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    _assert_equal(out[1], out[0])


# -- what it does not keep: recomputed as without the option --------------------------------------------------------


def _packed(flash_kwargs: bool) -> dict:
    g = torch.Generator().manual_seed(4)
    feats = [{"input_ids": torch.randint(0, V, (n,), generator=g).tolist()} for n in (5, 13, 1, 9)]
    return dict(DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)(feats))


def _padded() -> dict:
    x = _tokens(2, 17, seed=5)
    mask = torch.ones_like(x)
    mask[1, 11:] = 0
    return dict(input_ids=x, attention_mask=mask, labels=x.masked_fill(mask == 0, -100))


@pytest.mark.parametrize(
    "family,kw,batch,kept",
    [
        ("llama", {}, lambda: _packed(flash_kwargs=False), 0),  # documents from restarting position ids
        ("llama", {}, lambda: _packed(flash_kwargs=True), 0),  # the collator's cu_seq_lens
        ("llama", {}, _padded, 0),
        ("mistral", dict(sliding_window=7), lambda: dict(input_ids=_tokens(2, 23), labels=_tokens(2, 23)), 0),
        ("mistral", dict(sliding_window=64), lambda: dict(input_ids=_tokens(2, 23), labels=_tokens(2, 23)), L),
        ("gemma2", {}, lambda: dict(input_ids=_tokens(2, 23), labels=_tokens(2, 23)), 1),  # its full layer
        ("gemma2", dict(attn_logit_softcapping=30.0), lambda: dict(input_ids=_tokens(2, 23), labels=_tokens(2, 23)),
         0),
    ],
    ids=("packed-positions", "packed-cu-seqlens", "padding", "window", "window-longer-than-S", "gemma2",
         "softcap"),
)  # fmt: skip
def test_what_cannot_be_kept_is_recomputed(family, kw, batch, kept):
    batch = batch()
    want = _step(lt.apply(_model(family, **kw), **FULL), batch)
    with _counting() as counts:
        got = _step(lt.apply(_model(family, **kw), recompute_skip_core_attention=True, **FULL), batch)
    _assert_equal(got, want)
    assert counts["kept forward"] == counts["kept backward"] == kept


@pytest.mark.parametrize("family,kw", [("llama", {}), ("mistral", dict(sliding_window=7))], ids=("packed", "window"))
def test_fallbacks_equal_the_plain_model(family, kw):
    """The recomputed fallbacks against transformers' own SDPA model: packed documents (restarting position ids)
    and a sliding window shorter than the sequence."""
    batch = _packed(flash_kwargs=False) if family == "llama" else dict(input_ids=_tokens(2, 23))
    ref = _model(family, **kw)
    ref.set_attn_implementation("sdpa")
    logits = ref(**batch, use_cache=False).logits  # SDPA finds packed documents only without a KV cache
    labels = batch.get("labels", batch["input_ids"])
    ref_loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
    ref_loss.backward()
    model = lt.apply(_model(family, **kw), recompute_skip_core_attention=True, **FULL)
    loss, got = _step(model, dict(batch, labels=labels))
    _assert_close_to(loss, got, ref_loss, ref)


# -- what it refuses ------------------------------------------------------------------------------------------------


def test_bad_settings_raise():
    with pytest.raises(ValueError, match=r"recompute_skip_core_attention .* needs recompute_granularity='full' "
                                         r"\(got None\).*pass recompute_granularity='full'"):  # fmt: skip
        lt.apply(_model(), recompute_skip_core_attention=True)
    with pytest.raises(ValueError, match=r"recompute_granularity='full' \(got 'selective'\)"):
        lt.apply(_model(), recompute_granularity="selective", recompute_skip_core_attention=True)
    with pytest.raises(ValueError, match=r"config.attention_dropout == 0 \(got 0.1\)"):
        lt.apply(_model(attention_dropout=0.1), recompute_skip_core_attention=True, **FULL)
    with pytest.raises(ValueError, match="context parallelism.*recompute_skip_core_attention=False"):
        lt.apply(_model(), recompute_skip_core_attention=True, context_parallel_group=object(), **FULL)
    with pytest.raises(TypeError, match="recompute_skip_core_attention must be True or False, got 'yes'"):
        lt.apply(_model(), recompute_skip_core_attention="yes", **FULL)
