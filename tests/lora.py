"""PEFT's LoRA adapters as the tests put them on a transformers model."""

from __future__ import annotations

import torch

from longctx.memory.model import LORA_TARGETS


def with_lora(model, *, rank: int = 4, seed: int = 1, targets=LORA_TARGETS):
    """``model`` under PEFT's LoRA adapters of ``rank`` (alpha twice that, no dropout) on ``targets`` (default:
    q, k, v, o, gate, up, down), drawn from ``seed`` with B non-zero (``init_lora_weights=False``) so that every
    adapter gradient is exercised."""
    import peft

    torch.manual_seed(seed)
    cfg = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets), lora_dropout=0.0,
                          init_lora_weights=False)  # fmt: skip
    return peft.get_peft_model(model, cfg)
