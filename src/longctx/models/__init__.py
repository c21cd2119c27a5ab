"""Models built from longctx layers."""

from __future__ import annotations

from longctx.models.gpt import GPT, PRESETS, GPTConfig, TransformerLayer, lm_loss

__all__ = ["GPT", "GPTConfig", "PRESETS", "TransformerLayer", "lm_loss"]
