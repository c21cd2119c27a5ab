"""The peak memory of a training step of a transformers causal LM under `apply`, counted on the model itself.

`step_memory(config, seq_length=S, lora=LoraConfig(...), apply_kwargs={...})` builds the model of ``config`` (and its
PEFT adapters) without memory (PyTorch's meta device, then shape-only tensors of FakeTensorMode), puts longctx in it
with ``apply(**apply_kwargs)``, and runs one whole forward and backward at S under bf16 autocast while
`longctx.memory.LiveBytesTracker` counts the bytes of every live tensor, as `longctx.memory.model` does for the
longctx GPT. What the trace cannot run is replaced by what has the same memory: the attention kernels by the
flash twin of the memory model (q, k, v, out and the float32 lse kept; dq, dk, dv and the float32 accumulator in
the backward; with ``recompute_skip_core_attention`` the same twin keeps each recomputed layer's out and lse from the
forward to its recomputation), and the two data-dependent checks for packed documents (a row is one sequence here).
To the traced peak (the gradients of what trains included) it adds the parameters, AdamW's two float32 states for
what trains, and the fixed allowance for the CUDA libraries.

So transformers' own layers (its norms in float32, PEFT's casts) are counted as they run: for Llama-3.1-8B's shape
under LoRA, the prediction was within 1% of the H200's measured peak at 32K and 128K tokens (docs/memory.md).

With ``apply_kwargs={"offload_params": True}`` (the states in host memory, FSDP2 over the decoder layers) the step
is traced with the weights in bf16 (FSDP2's mixed precision) and each gradient dropped once made, and the GPU holds
the units in flight instead of the whole model (`longctx.memory.model.units_in_flight`), as the memory model does
for the GPT. ``host`` is the host side: the offloaded states (their pinned blocks rounded as torch's pinned
allocator rounds them), the offloaded checkpoints and the process.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
from torch import nn

__all__ = ["StepPeak", "step_memory"]


@dataclass(frozen=True)
class StepPeak:
    """The predicted GPU peak of one training step, in bytes: ``total`` = parameters + optimizer_states + traced +
    overhead (``traced``: every tensor the forward and backward hold at their peak, the gradients included; with
    ``offload_params``, ``parameters`` are the units in flight). ``host``: the host memory of the step (offloaded
    states and checkpoints, the process)."""

    seq_length: int
    parameters: int
    trained_parameters: int
    optimizer_states: int
    traced: int
    overhead: int
    host: int = 0
    offload_params: bool = False

    @property
    def total(self) -> int:
        return self.parameters + self.optimizer_states + self.traced + self.overhead


def _twin_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **_: Any) -> torch.Tensor:
    from longctx.memory.model import _FlashTwin

    return _FlashTwin.apply(q, k, v)


def _shape_only(model: nn.Module, mode: Any) -> None:
    """Every meta parameter and buffer of ``model`` replaced by a shape-only CPU tensor of ``mode`` (in place; the
    parameters keep their ``requires_grad``)."""
    for m in model.modules():
        for name, p in list(m._parameters.items()):
            if p is not None:
                with mode:
                    m._parameters[name] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype), p.requires_grad)
        for name, b in list(m._buffers.items()):
            if b is not None:
                with mode:
                    m._buffers[name] = torch.zeros(b.shape, dtype=b.dtype)


def build(config: Any, dtype: torch.dtype, lora: Any = None, apply_kwargs: dict[str, Any] | None = None) -> nn.Module:
    """The causal LM of ``config`` in ``dtype`` on the meta device, under PEFT's adapters of ``lora`` (a
    ``peft.LoraConfig``) if given, with longctx applied (``apply(**apply_kwargs)``) when ``apply_kwargs`` is not
    None. (Also what the tests use to build the same model for real.)"""
    from transformers import AutoModelForCausalLM

    from longctx.integrations.transformers.apply import apply

    model = AutoModelForCausalLM.from_config(config, attn_implementation="longctx", dtype=dtype)
    model.train()
    if lora is not None:
        import peft

        model = peft.get_peft_model(model, lora)
    if apply_kwargs is not None:
        apply(model, **apply_kwargs)
    return model


@contextlib.contextmanager
def shape_only_step():
    """The replacements a traced step needs: the attention kernels' twin (for the kept attention of
    ``recompute_skip_core_attention`` too: its launchers), the fused norm and gate kernels' twins, and no
    data-dependent search for packed documents (transformers' and longctx's: every row is one sequence)."""
    import transformers.masking_utils as masking

    import longctx.integrations.transformers.attention as attention
    import longctx.layers.attention as attention_layer
    from longctx.memory.model import _TwinLaunchers
    from longctx.ops import pointwise

    with mock.patch.object(attention, "attention", _twin_attention), pointwise.twins(), \
            mock.patch.object(attention_layer, "resolve_launchers", lambda *a, **k: _TwinLaunchers), \
            mock.patch.object(masking, "find_packed_sequence_indices", lambda *a, **k: None), \
            mock.patch.object(attention, "_varlen_from_positions", lambda *a, **k: None):  # fmt: skip
        yield


def step_memory(
    config: Any,
    *,
    seq_length: int,
    micro_batch_size: int = 1,
    dtype: torch.dtype = torch.float32,
    lora: Any = None,
    apply_kwargs: dict[str, Any] | None = None,
    autocast_dtype: torch.dtype | None = torch.bfloat16,
    overhead: int | None = None,
) -> StepPeak:
    """Predicted peak GPU memory of one training step (forward, backward, AdamW) of the transformers causal LM of
    ``config`` under `apply`.

    Args:
        config: a transformers config of a causal LM (``LlamaConfig(...)``, ``AutoConfig.from_pretrained(name)``).
        seq_length: tokens per sequence; micro_batch_size: sequences per step.
        dtype: the weights' dtype (bf16 for a LoRA run's frozen base, fp32 for full training under autocast).
        lora: a ``peft.LoraConfig``: the model under PEFT's adapters (only they train); None trains every weight.
        apply_kwargs: the settings of `apply` (recomputation, ``cpu_offloading``, ``fused_loss``, ``offload_params``
            with its ``mesh``: the states sharded over ``mesh.size()`` ranks, and ``offload_resident_units``: those
            units' states on the GPU); default {}.
        autocast_dtype: the autocast of training (bf16), or None.
        overhead: the CUDA libraries' allowance (default the memory model's).

    Returns:
        A `StepPeak`.

    Raises:
        ValueError: a bad length, settings `apply` rejects, or offload_params with lora.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from longctx.memory.measure import LiveBytesTracker
    from longctx.memory.model import (
        CUDA_OVERHEAD_BYTES,
        HOST_OVERHEAD_BYTES,
        host_state_bytes,
        shard_elements,
        units_in_flight,
    )

    for name, value in (("seq_length", seq_length), ("micro_batch_size", micro_batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    settings = dict(apply_kwargs or {})
    offload = settings.pop("offload_params", False)
    resident_units = settings.pop("offload_resident_units", 0)
    mesh = settings.pop("mesh", None)
    shards = 1 if mesh is None else mesh.size()  # the ranks the states are sharded over
    if offload and lora is not None:
        raise ValueError("offload_params with lora is not modelled: a LoRA run's frozen base stays on the GPU")
    weights = torch.bfloat16 if offload else dtype  # FSDP2's mixed precision: the units compute in bf16
    with torch.device("meta"):
        model = build(config, weights, lora, settings)
    mode = FakeTensorMode()
    _shape_only(model, mode)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    host = HOST_OVERHEAD_BYTES + _offloaded_checkpoints(model, settings, micro_batch_size * seq_length, weights)
    resident = late = 0  # elements of the resident units' shards; of them, the root's and embedding's
    if offload:  # each gradient goes to the host once made (counted in the units in flight)
        from longctx.distributed.mesh import decoder_units
        from longctx.distributed.offload import unit_parameters
        from longctx.integrations.transformers.apply import _decoder

        units = decoder_units(model)
        in_units = {id(p) for u in units for p in u.parameters()}
        layer = sum(p.numel() for p in units[-1].parameters())
        root = sum(p.numel() for p in model.parameters() if id(p) not in in_units)
        params = units_in_flight(layer, root, shards, 2)
        owners = unit_parameters(model, units)
        if not 0 <= resident_units <= len(owners):
            raise ValueError(f"offload_resident_units must be from 0 to {len(owners)} (the model's units), got "
                             f"{resident_units!r}")  # fmt: skip
        in_layers = {id(p) for p in _decoder(model).layers.parameters()}
        kept = [p for ps in owners[:resident_units] for p in ps]
        shard = [shard_elements(p.shape, shards) for p in kept]
        resident = sum(shard)
        late = sum(n for p, n in zip(kept, shard, strict=True) if id(p) not in in_layers)
        kept_ids = {id(p) for p in kept}
        host += host_state_bytes([p.shape for p in model.parameters() if id(p) not in kept_ids], shards)
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    tracker = LiveBytesTracker()
    autocast = torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype is not None else contextlib.nullcontext()
    with mode, shape_only_step():
        x = torch.zeros(micro_batch_size, seq_length, dtype=torch.long)
        with tracker:
            with autocast:
                loss = model(input_ids=x, labels=x).loss
            loss.backward()
            del loss
    # resident units: fp32 weights and AdamW's states all step; the layers' gradients counted as held at the peak
    # (an upper bound: each is made in its layer's backward), the root's and the embedding's only after the backward
    traced = max(tracker.peak + 4 * (resident - late), 4 * resident)  # or the backward's end: every gradient
    return StepPeak(
        seq_length=seq_length,
        parameters=params + 4 * resident,
        trained_parameters=trained,
        optimizer_states=8 * resident if offload else 8 * trained,
        traced=traced,
        overhead=CUDA_OVERHEAD_BYTES if overhead is None else overhead,
        host=host,
        offload_params=offload,
    )


def _offloaded_checkpoints(model: nn.Module, settings: dict[str, Any], tokens: int, dtype: torch.dtype) -> int:
    """Pinned host bytes of the checkpoints `apply`'s ``cpu_offloading`` moves there: one (tokens, hidden) layer
    input in the weights' dtype (the residual stream's) per offloaded layer."""
    if not settings.get("cpu_offloading"):
        return 0
    cfg = model.config if hasattr(model, "config") else model.get_base_model().config
    n = settings.get("cpu_offloading_num_layers") or cfg.num_hidden_layers
    return n * tokens * cfg.hidden_size * torch.empty((), dtype=dtype).element_size()
