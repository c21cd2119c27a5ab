"""A decoder-only GPT: pre-norm RMSNorm, rotary positions, SwiGLU, GQA, attention through `longctx.attention`.

Reads top to bottom like nanoGPT's model.py: the config, one transformer layer, the model, the loss.
Field names follow Megatron-LM (``num_layers``, ``hidden_size``, ``num_query_groups``, ``ffn_hidden_size``,
``recompute_granularity`` ...), so a Megatron or NeMo user can read a config without a glossary.

Seams for context parallelism (longctx.distributed):

* ``model(tokens, position_ids=...)``: RoPE uses the positions given, so a rank holding a (zigzag, hence
  non-contiguous) shard of the sequence rotates with global positions. position_ids is (S,) or (B, S).
* ``model.set_core_attention(fn)``: every layer calls ``fn(q, k, v)`` (q (B, Hq, S_local, D); k, v
  (B, Hkv, S_local, D), un-repeated) instead of ``longctx.attention(q, k, v, causal=True, ...)``; pass
  None to restore the default.
* ``model(tokens, labels=labels, loss_mask=m, reduction="sum")`` returns the summed loss of the local tokens
  without materialising the logits (`longctx.linear_cross_entropy`); divide by the all-reduced token count to
  get the global mean. ``lm_loss(logits, labels, ...)`` does the same from logits a caller already has.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from longctx.layers.attention import CoreAttentionFn, SelfAttention
from longctx.layers.loss import linear_cross_entropy
from longctx.layers.mlp import SwiGLUMLP
from longctx.layers.norms import RMSNorm
from longctx.layers.offload import ActivationOffloader
from longctx.layers.recompute import (
    plan_layers,
    recompute_active,
    run_in_chunks,
    run_layers,
    validate_recompute,
)
from longctx.layers.rotary import RotaryEmbedding

__all__ = ["GPTConfig", "PRESETS", "TransformerLayer", "GPT", "lm_loss"]


# ---------------------------------------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class GPTConfig:
    """Shape and behaviour of a `GPT`; validated on construction (ValueError/TypeError saying what to fix).

    Use a preset and override fields: ``GPTConfig.preset("gpt2-medium", seq_length=8192)``.
    """

    vocab_size: int = 50304
    seq_length: int = 1024  # training length; RoPE itself has no maximum
    num_layers: int = 12
    hidden_size: int = 768
    num_attention_heads: int = 12
    num_query_groups: int | None = None  # None: multi-head; 1: MQA; a divisor of the heads: GQA
    ffn_hidden_size: int | None = None  # None: SwiGLU's 8/3 h, rounded up to a multiple of 64
    kv_channels: int | None = None  # head dim; None: hidden_size // num_attention_heads
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    attention_backend: str = "auto"  # any name from longctx.backends(), or "auto"
    recompute_granularity: str | None = None  # None, "full" or "selective" (see longctx.layers.recompute)
    recompute_method: str | None = None  # "uniform" or "block" (full only)
    recompute_num_layers: int | None = None  # 1..num_layers (full only)
    # tokens per chunk of the position-wise part of a layer (norm, MLP, residual) in training: each chunk is
    # recomputed in the backward, so the layer's working set is one chunk's (chunk, ffn) intermediates instead of
    # (S, ffn); None runs it whole
    sequence_chunk_size: int | None = None
    # Megatron's activation offloading: the inputs that fully recomputed layers keep for backward go to pinned host
    # memory, copied on a side stream behind the compute and back one layer ahead of its backward
    # (longctx.layers.offload). Needs recompute_granularity="full"; cpu_offloading_num_layers: the first N layers
    # (default: every layer); only activations are offloaded (cpu_offloading_activations must stay True).
    cpu_offloading: bool = False
    cpu_offloading_num_layers: int | None = None
    cpu_offloading_activations: bool = True
    # with full recomputation, keep each recomputed layer's attention output and log-sum-exp so the recomputed
    # forward skips attention (LightSeq's rematerialization-aware checkpointing; longctx.layers.attention): one
    # (S, Hq D) output and one (Hq, S) float32 lse more per layer, one attention forward less per step
    recompute_skip_core_attention: bool = False
    share_embeddings_and_output_weights: bool = True  # tied input and output embeddings
    rotary_base: float = 10000.0
    layernorm_epsilon: float = 1e-5
    init_method_std: float = 0.02
    add_bias_linear: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_length", "num_layers", "hidden_size", "num_attention_heads"):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {val!r}")
        for name in ("ffn_hidden_size", "kv_channels", "sequence_chunk_size"):
            val = getattr(self, name)
            if val is not None and (isinstance(val, bool) or not isinstance(val, int) or val < 1):
                raise ValueError(f"GPTConfig.{name} must be a positive int or None, got {val!r}")
        heads = self.num_attention_heads
        g = self.num_query_groups
        if g is not None and (isinstance(g, bool) or not isinstance(g, int) or g < 1 or heads % g != 0):
            raise ValueError(
                f"GPTConfig.num_query_groups={g!r} is invalid for num_attention_heads={heads}: valid values are "
                f"None (multi-head attention), 1 (multi-query) or a divisor of {heads} (grouped-query): "
                f"{_divisors(heads)}"
            )
        if self.kv_channels is None and self.hidden_size % heads != 0:
            raise ValueError(
                f"GPTConfig.hidden_size={self.hidden_size} is not divisible by num_attention_heads={heads}; "
                "choose sizes that divide, or set kv_channels (the head dim) explicitly"
            )
        if self.head_dim % 2:
            raise ValueError(f"the head dim (kv_channels) must be even for rotary embeddings, got {self.head_dim}")
        for name in ("attention_dropout", "hidden_dropout"):
            p = getattr(self, name)
            if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
                raise ValueError(f"GPTConfig.{name} must be a probability in [0, 1), got {p!r}")
        if not isinstance(self.attention_backend, str):
            raise TypeError(f"GPTConfig.attention_backend must be a str, got {type(self.attention_backend).__name__}")
        if self.attention_backend != "auto":
            from longctx.dispatch import backend_names

            if self.attention_backend not in backend_names():
                raise ValueError(
                    f"GPTConfig.attention_backend={self.attention_backend!r} is not a registered backend; "
                    f"expected 'auto' or one of {backend_names()}"
                )
        validate_recompute(
            self.recompute_granularity, self.recompute_method, self.recompute_num_layers, self.num_layers
        )
        for name in (
            "cpu_offloading",
            "cpu_offloading_activations",
            "recompute_skip_core_attention",
            "share_embeddings_and_output_weights",
        ):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"GPTConfig.{name} must be True or False, got {getattr(self, name)!r}")
        n_off = self.cpu_offloading_num_layers
        if n_off is not None and (
            isinstance(n_off, bool) or not isinstance(n_off, int) or not 1 <= n_off <= self.num_layers
        ):
            raise ValueError(
                f"GPTConfig.cpu_offloading_num_layers must be an int in [1, num_layers={self.num_layers}] or None "
                f"(every layer), got {n_off!r}"
            )
        if self.cpu_offloading:
            if self.recompute_granularity != "full":
                raise ValueError(
                    "cpu_offloading moves the inputs of fully recomputed layers to host memory: set "
                    "recompute_granularity='full' (with recompute_method and recompute_num_layers), got "
                    f"recompute_granularity={self.recompute_granularity!r}"
                )
            if not self.cpu_offloading_activations:
                raise ValueError(
                    "cpu_offloading offloads activations only: cpu_offloading_activations=False would offload "
                    "nothing (weight offloading is not supported)"
                )
        if self.recompute_skip_core_attention and (self.recompute_granularity != "full" or self.attention_dropout > 0):
            raise ValueError(
                "recompute_skip_core_attention keeps the attention output of fully recomputed layers: it needs "
                f"recompute_granularity='full' (got {self.recompute_granularity!r}) and attention_dropout == 0 "
                f"(got {self.attention_dropout})"
            )
        if not (self.layernorm_epsilon > 0 and self.rotary_base > 0 and self.init_method_std > 0):
            raise ValueError("layernorm_epsilon, rotary_base and init_method_std must be positive")

    # derived sizes
    @property
    def head_dim(self) -> int:
        return self.kv_channels if self.kv_channels is not None else self.hidden_size // self.num_attention_heads

    @property
    def kv_heads(self) -> int:
        return self.num_query_groups if self.num_query_groups is not None else self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        return 64 * math.ceil(8 * self.hidden_size / 3 / 64)

    def replace(self, **changes) -> GPTConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def preset(cls, name: str, **overrides) -> GPTConfig:
        """A named shape (see `PRESETS`), with any field overridden."""
        if name not in PRESETS:
            raise ValueError(f"unknown GPT preset {name!r}; expected one of {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})


PRESETS: dict[str, dict] = {
    # CPU tests: a few hundred thousand parameters; GQA (4 query heads over 2 kv heads).
    "tiny": dict(
        vocab_size=128, seq_length=64, num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
        ffn_hidden_size=128,
    ),
    # The default of `longctx train` (the embedded recall task; a few minutes on 2 CPU cores): ~85K parameters.
    "demo": dict(
        vocab_size=32, seq_length=128, num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
    ),
    # GPT-2 small/medium shapes (tied embeddings, multi-head) with SwiGLU sized to GPT-2's MLP parameter count.
    "gpt2-small": dict(
        vocab_size=50304, seq_length=1024, num_layers=12, hidden_size=768, num_attention_heads=12,
        ffn_hidden_size=2048,
    ),
    "gpt2-medium": dict(  # ~350M parameters: the recompute benchmark's model
        vocab_size=50304, seq_length=4096, num_layers=24, hidden_size=1024, num_attention_heads=16,
        ffn_hidden_size=2752,
    ),
    # Llama-like: GQA with 4 kv heads, untied embeddings, 32K vocabulary; ~330M parameters.
    "llama-350m": dict(
        vocab_size=32000, seq_length=4096, num_layers=24, hidden_size=1024, num_attention_heads=16,
        num_query_groups=4, ffn_hidden_size=2816, share_embeddings_and_output_weights=False, rotary_base=500000.0,
    ),
    "llama-1b": dict(
        vocab_size=32000, seq_length=8192, num_layers=16, hidden_size=2048, num_attention_heads=32,
        num_query_groups=8, ffn_hidden_size=8192, share_embeddings_and_output_weights=False, rotary_base=500000.0,
    ),
    # Llama-3.2-3B's shape (tied embeddings, 128K vocabulary): ~3.2B parameters.
    "llama-3b": dict(
        vocab_size=128256, seq_length=8192, num_layers=28, hidden_size=3072, num_attention_heads=24,
        num_query_groups=8, ffn_hidden_size=8192, share_embeddings_and_output_weights=True, rotary_base=500000.0,
    ),
    # Llama-3.1-8B's shape: ~8.0B parameters; fp32 weights, gradients and AdamW states are 16 bytes each (128 GB),
    # more than one GPU holds: train it with offload_params (longctx.distributed.offload).
    "llama-8b": dict(
        vocab_size=128256, seq_length=8192, num_layers=32, hidden_size=4096, num_attention_heads=32,
        num_query_groups=8, ffn_hidden_size=14336, share_embeddings_and_output_weights=False, rotary_base=500000.0,
    ),
}  # fmt: skip


# ---------------------------------------------------------------------------------------------------------
# one transformer layer
# ---------------------------------------------------------------------------------------------------------


class TransformerLayer(nn.Module):
    """Pre-norm block: ``x + drop(attn(norm(x)))``, then ``x + drop(mlp(norm(x)))``. The unit of full recompute."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        c = config
        self.input_layernorm = RMSNorm(c.hidden_size, c.layernorm_epsilon)
        self.self_attention = SelfAttention(
            c.hidden_size,
            c.num_attention_heads,
            c.kv_heads,
            c.head_dim,
            attention_dropout=c.attention_dropout,
            backend=c.attention_backend,
            bias=c.add_bias_linear,
        )
        self.pre_mlp_layernorm = RMSNorm(c.hidden_size, c.layernorm_epsilon)
        self.mlp = SwiGLUMLP(c.hidden_size, c.ffn_size, bias=c.add_bias_linear)
        self.hidden_dropout = nn.Dropout(c.hidden_dropout)
        self.sequence_chunk_size = c.sequence_chunk_size

    def _mlp_block(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.hidden_dropout(self.mlp(self.pre_mlp_layernorm(x)))  # (B, s, h): position-wise

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.hidden_dropout(self.self_attention(self.input_layernorm(x), cos, sin))  # (B, S, h)
        # Sequence-chunked in training: each chunk keeps only its input for backward and is recomputed there, so the
        # MLP's (chunk, ffn) intermediates exist for one chunk at a time, in the forward and in the backward.
        return run_in_chunks(self._mlp_block, x, self.sequence_chunk_size, self)  # (B, S, h)


# ---------------------------------------------------------------------------------------------------------
# the model
# ---------------------------------------------------------------------------------------------------------


class GPT(nn.Module):
    """Decoder-only language model. ``model(tokens)`` with tokens (B, S) int64 -> logits (B, S, vocab_size).

    Args:
        config: a `GPTConfig`.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise TypeError(f"GPT needs a GPTConfig, got {type(config).__name__}")
        c = self.config = config
        self.embedding = nn.Embedding(c.vocab_size, c.hidden_size)
        self.embedding_dropout = nn.Dropout(c.hidden_dropout)
        self.rotary = RotaryEmbedding(c.head_dim, c.rotary_base)
        self.layers = nn.ModuleList(TransformerLayer(c) for _ in range(c.num_layers))
        self.final_layernorm = RMSNorm(c.hidden_size, c.layernorm_epsilon)
        self.output_layer = (
            None if c.share_embeddings_and_output_weights else nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        )
        self._init_weights()
        self._apply_recompute()

    def _init_weights(self) -> None:
        # Megatron's init: N(0, std) everywhere; the projections that write into the residual stream
        # (linear_proj, linear_fc2) scaled by 1/sqrt(2 * num_layers).
        std = self.config.init_method_std
        out_std = std / math.sqrt(2.0 * self.config.num_layers)
        for name, p in self.named_parameters():
            if p.dim() < 2:
                if name.endswith("bias"):
                    nn.init.zeros_(p)
                continue
            is_out = name.endswith("linear_proj.weight") or name.endswith("linear_fc2.weight")
            nn.init.normal_(p, mean=0.0, std=out_std if is_out else std)

    def _apply_recompute(self) -> None:
        c = self.config
        self._chunks = plan_layers(c.recompute_granularity, c.recompute_method, c.recompute_num_layers, c.num_layers)
        replay = c.cpu_offloading or c.recompute_skip_core_attention
        self._offloader = ActivationOffloader() if replay else None
        self._offload_layers = (c.cpu_offloading_num_layers or c.num_layers) if c.cpu_offloading else 0
        for layer in self.layers:
            layer.self_attention.recompute_core_attention = c.recompute_granularity == "selective"
            layer.self_attention.keep_core_attention = c.recompute_skip_core_attention

    def set_recompute(
        self, granularity: str | None = None, method: str | None = None, num_layers: int | None = None
    ) -> None:
        """Change the recomputation policy in place (the config is replaced by a validated copy)."""
        self.config = self.config.replace(
            recompute_granularity=granularity, recompute_method=method, recompute_num_layers=num_layers
        )
        self._apply_recompute()

    def set_core_attention(self, fn: CoreAttentionFn | None) -> None:
        """Install ``fn(q, k, v) -> out`` as the core attention of every layer (None: the default).

        q (B, Hq, S, D), k and v (B, Hkv, S, D) after RoPE; out (B, Hq, S, D). Context parallelism uses it
        to put ring/all-gather/Ulysses attention in place of ``longctx.attention(causal=True)``.
        """
        for layer in self.layers:
            layer.self_attention.set_core_attention(fn)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    @property
    def output_weight(self) -> torch.Tensor:
        """The output projection's weight (vocab_size, hidden_size): the embedding's when they are shared."""
        return self.embedding.weight if self.output_layer is None else self.output_layer.weight

    def hidden_states(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (B, S) int; position_ids (S,) or (B, S), default arange(S) -> final hidden states (B, S, h),
        after the final norm: what the output projection reads."""
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.is_floating_point():
            got = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__
            raise ValueError(f"tokens must be an integer tensor of shape (batch, seq), got {got}")
        B, S = tokens.shape
        capturing = tokens.is_cuda and torch.cuda.is_current_stream_capturing()
        shape_only = tokens.is_meta or is_fake(tokens)  # the memory model's trace has no values to check
        if tokens.numel() and not (torch.compiler.is_compiling() or capturing or shape_only):  # eager mode only
            lo, hi = (int(x) for x in torch.aminmax(tokens))
            if lo < 0 or hi >= self.config.vocab_size:
                raise ValueError(
                    f"token ids must be in [0, vocab_size={self.config.vocab_size}), got ids from {lo} to {hi}; "
                    "tokenize with the model's vocabulary, or set GPTConfig.vocab_size above the largest id"
                )
        if position_ids is None:
            position_ids = torch.arange(S, device=tokens.device)
        elif position_ids.shape[-1] != S:
            raise ValueError(
                f"position_ids must end with the sequence length {S}, got shape {tuple(position_ids.shape)}"
            )
        cos, sin = self.rotary(position_ids)  # (S, D) or (B, S, D), float32

        x = self.embedding_dropout(self.embedding(tokens))  # (B, S, h)
        x = run_layers(
            self.layers, x, self._chunks, cos, sin, active=recompute_active(self),
            offloader=self._offloader, offload_layers=self._offload_layers,
        )  # fmt: skip
        return self.final_layernorm(x)  # (B, S, h)

    def forward(
        self,
        tokens: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        *,
        labels: torch.Tensor | None = None,
        loss_mask: torch.Tensor | None = None,
        reduction: str = "mean",
    ) -> torch.Tensor:
        """Logits, or with ``labels`` the loss without ever holding the logits.

        Args:
            tokens: (B, S) integer token ids.
            position_ids: (S,) or (B, S) positions for RoPE, default arange(S).
            labels: (B, S) target ids; given, the model returns the cross-entropy computed by
                `longctx.linear_cross_entropy` (chunks of tokens, float32 log-sum-exp) instead of the logits.
            loss_mask: (B, S), the tokens that count (with labels only).
            reduction: "mean" over the counted tokens, or "sum" (context parallelism sums over ranks).

        Returns:
            logits (B, S, vocab_size) without labels; the scalar float32 loss with them.
        """
        x = self.hidden_states(tokens, position_ids)  # (B, S, h)
        if labels is None:
            if loss_mask is not None:
                raise ValueError("loss_mask is only used together with labels")
            return F.linear(x, self.output_weight)  # (B, S, vocab)
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
        return linear_cross_entropy(x, self.output_weight, labels, loss_mask=loss_mask, reduction=reduction)


# ---------------------------------------------------------------------------------------------------------
# the loss
# ---------------------------------------------------------------------------------------------------------


def lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: torch.Tensor | None = None,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross-entropy of logits (B, S, V) against labels (B, S), in float32 (float64 for float64 logits).

    loss_mask (B, S) selects the tokens that count (1/True) - e.g. only the answers of the recall task.
    ``reduction="sum"`` returns the sum over counted tokens (context parallelism: all-reduce it and the
    count, then divide); ``"mean"`` divides by the local count.
    """
    acc = logits if logits.dtype == torch.float64 else logits.float()  # float32 (float64 stays float64)
    per_token = F.cross_entropy(acc.flatten(0, 1), labels.flatten(), reduction="none")  # (B S,)
    if loss_mask is not None:
        m = loss_mask.flatten().to(per_token.dtype)
        total, count = (per_token * m).sum(), m.sum()
    else:
        total, count = per_token.sum(), torch.tensor(float(per_token.numel()), device=per_token.device)
    if reduction == "sum":
        return total
    if reduction != "mean":
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    return total / count.clamp_min(1.0)
