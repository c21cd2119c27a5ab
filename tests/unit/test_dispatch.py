"""Backend selection, explain() and the environment switches."""

from __future__ import annotations

import pytest
import torch

import longctx
from longctx.dispatch import AttnInputs, get_backend, reasons_for
from longctx.masks import Band


@pytest.fixture
def qkv():
    return torch.randn(1, 4, 64, 32), torch.randn(1, 2, 64, 32), torch.randn(1, 2, 64, 32)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for var in (
        "LONGCTX_ATTN_BACKEND",
        "LONGCTX_FLASH_ATTN",
        "LONGCTX_FUSED_ATTN",
        "NVTE_FLASH_ATTN",
        "NVTE_FUSED_ATTN",
    ):
        monkeypatch.delenv(var, raising=False)


def test_auto_on_cpu_picks_tiled(qkv):
    choice = longctx.explain(*qkv, causal=True)
    assert choice.backend.name == "tiled" and choice.how == "auto"
    text = str(choice)
    assert "selected: tiled" in text
    # every higher-priority backend says why it was rejected
    for name in ("sdpa_cudnn", "sdpa_flash", "flex", "sdpa_efficient"):
        assert name in choice.rejected and choice.rejected[name]
    assert "CUDA" in " ".join(choice.rejected["sdpa_flash"])
    assert choice.rejected["math"] == ["lower priority than tiled"]


@pytest.mark.parametrize("var", ["LONGCTX_FLASH_ATTN", "NVTE_FLASH_ATTN"])
def test_flash_switch_disables_tiled(qkv, monkeypatch, var):
    monkeypatch.setenv(var, "0")
    choice = longctx.explain(*qkv, causal=True)
    assert choice.backend.name == "math"
    assert any(var in r for r in choice.rejected["tiled"])
    # pinning a disabled backend raises with the reason
    with pytest.raises(ValueError, match=var):
        longctx.attention(*qkv, backend="tiled")


@pytest.mark.parametrize("var", ["LONGCTX_FUSED_ATTN", "NVTE_FUSED_ATTN"])
def test_fused_switch_disables_cudnn(monkeypatch, var):
    monkeypatch.setenv(var, "0")
    be = get_backend("sdpa_cudnn")
    inp = AttnInputs(torch.device("cuda"), torch.bfloat16, 1, 8, 8, 1024, 1024, 128, Band(), False, capability=(9, 0))
    assert any(var in r for r in reasons_for(be, inp))
    monkeypatch.delenv(var)
    assert reasons_for(be, inp) == []


def test_switch_read_at_call_time(qkv, monkeypatch):
    assert longctx.explain(*qkv).backend.name == "tiled"
    monkeypatch.setenv("LONGCTX_FLASH_ATTN", "0")
    assert longctx.explain(*qkv).backend.name == "math"
    monkeypatch.setenv("LONGCTX_FLASH_ATTN", "1")
    assert longctx.explain(*qkv).backend.name == "tiled"


def test_env_pins_backend(qkv, monkeypatch):
    monkeypatch.setenv("LONGCTX_ATTN_BACKEND", "math")
    choice = longctx.explain(*qkv)
    assert choice.backend.name == "math" and choice.how == "LONGCTX_ATTN_BACKEND"
    monkeypatch.setenv("LONGCTX_ATTN_BACKEND", "sdpa_cudnn")
    with pytest.raises(ValueError, match="LONGCTX_ATTN_BACKEND.*CUDA"):
        longctx.attention(*qkv)
    monkeypatch.setenv("LONGCTX_ATTN_BACKEND", "nope")
    with pytest.raises(ValueError, match="unknown attention backend"):
        longctx.attention(*qkv)


def test_argument_overrides_env(qkv, monkeypatch):
    monkeypatch.setenv("LONGCTX_ATTN_BACKEND", "math")
    assert longctx.explain(*qkv, backend="tiled").backend.name == "tiled"


def _cuda_inputs(**kw):
    base = dict(
        device=torch.device("cuda"),
        dtype=torch.bfloat16,
        batch=1,
        hq=8,
        hkv=8,
        sq=1024,
        sk=1024,
        head_dim=128,
        band=Band(),
        needs_grad=True,
        capability=(9, 0),
    )
    base.update(kw)
    return AttnInputs(**base)


def test_sdpa_declares_its_limits():
    flash = get_backend("sdpa_flash")
    assert reasons_for(flash, _cuda_inputs()) == []
    # top-left causal is what SDPA computes: accepted only when it equals bottom-right (Sq == Sk)
    assert reasons_for(flash, _cuda_inputs(band=Band.from_args(1024, 1024, True))) == []
    assert reasons_for(flash, _cuda_inputs(sq=512, band=Band.from_args(512, 1024, True)))
    assert reasons_for(flash, _cuda_inputs(band=Band.from_args(1024, 1024, True, (128, 0))))
    assert reasons_for(flash, _cuda_inputs(return_lse=True))
    assert reasons_for(flash, _cuda_inputs(dtype=torch.float32))
    cudnn = get_backend("sdpa_cudnn")
    assert any("deterministic" in r for r in reasons_for(cudnn, _cuda_inputs(deterministic=True)))
    assert any("capability" in r for r in reasons_for(cudnn, _cuda_inputs(capability=(8, 0))))
    eff = get_backend("sdpa_efficient")
    assert any("GQA" in r for r in reasons_for(eff, _cuda_inputs(hkv=2)))


def test_backends_listed_in_priority_order():
    names = longctx.backends()
    assert names[-2:] == ["tiled", "math"]
    assert names.index("sdpa_cudnn") < names.index("sdpa_flash") < names.index("tiled")
