"""`apply`: longctx's recomputation, activation offloading, logits-free loss, context parallelism and offloaded
states in a transformers causal LM (PEFT-wrapped or not), and `allreduce_gradients` for context parallelism."""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from longctx.distributed import ContextParallel
from longctx.distributed.comm import comm_device, group_info
from longctx.integrations.transformers.attention import ATTN_IMPLEMENTATION, _collecting, _varlen_kwargs
from longctx.layers.loss import linear_cross_entropy
from longctx.layers.offload import ActivationOffloader, offloaded_checkpoint
from longctx.layers.recompute import checkpoint_call, plan_layers, recompute_active, run_in_chunks
from longctx.ops.pointwise import rms_norm, swiglu

__all__ = ["FUSED_LOSS_MODELS", "LLAMA_MLPS", "LLAMA_NORMS", "apply", "allreduce_gradients"]

# Causal LMs whose forward is `logits = lm_head(model(...).last_hidden_state)` then ForCausalLMLoss, so the loss
# can be computed from the hidden states (Gemma2/3 only without final_logit_softcapping).
FUSED_LOSS_MODELS = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "GemmaForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
)


def _decoder(model: nn.Module) -> nn.Module:
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    if base is None or not isinstance(getattr(base, "layers", None), nn.ModuleList):
        raise TypeError(
            f"apply expects a causal LM whose base model holds its decoder layers in `.layers` (the Llama family), "
            f"got {type(model).__name__}"
        )
    return base


def _check_output(h: object, layer: nn.Module) -> torch.Tensor:
    if not isinstance(h, torch.Tensor):
        raise TypeError(
            f"{type(layer).__name__} returned {type(h).__name__}; layer recomputation needs decoder layers that return "
            "the hidden states tensor"
        )
    return h


# transformers' classes whose forward is Llama's: RMSNorm ``weight * (x32 * rsqrt(mean(x32^2) + eps)).to(x.dtype)``
# and the MLP ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``; others (Gemma's ``1 + weight`` norm, GELU gates) keep
# their own forward
LLAMA_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "MixtralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")
LLAMA_MLPS = ("LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP")


def _norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    if hidden_states.dtype == torch.float64:  # transformers' norm computes in float32 even here: keep it exactly
        return type(self).forward(self, hidden_states)
    y = rms_norm(hidden_states, self.weight, self.variance_epsilon)  # one kernel each way on a GPU
    return y.to(torch.promote_types(self.weight.dtype, hidden_states.dtype))  # transformers' output dtype


def _gated(act_fn: nn.Module, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if gate.shape != up.shape or gate.dtype != up.dtype:
        return act_fn(gate) * up
    return swiglu(gate, up)  # silu(gate) * up in one kernel each way on a GPU


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    # no local holds gate or up: without autograd (a recomputed layer's first forward) they are freed before down_proj
    return self.down_proj(_gated(self.act_fn, self.gate_proj(x), self.up_proj(x)))


def _fusable(layer: nn.Module) -> tuple[list[nn.Module], list[nn.Module]]:
    """The Llama-form RMSNorms (`LLAMA_NORMS`) and SiLU-gated MLPs (`LLAMA_MLPS`) of a decoder layer: what
    `_patch_pointwise` fuses (and `compile_ahead` compiles the kernels of)."""
    norms, mlps = [], []
    for m in layer.modules():
        name = type(m).__name__
        if (
            name in LLAMA_NORMS
            and isinstance(getattr(m, "weight", None), torch.Tensor)
            and hasattr(m, "variance_epsilon")
        ):
            norms.append(m)
        elif (
            name in LLAMA_MLPS
            and type(getattr(m, "act_fn", None)).__name__ in ("SiLU", "SiLUActivation")
            and all(isinstance(getattr(m, a, None), nn.Module) for a in ("gate_proj", "up_proj", "down_proj"))
        ):
            mlps.append(m)
    return norms, mlps


def _patch_pointwise(layers: nn.ModuleList) -> None:
    """Every Llama-form RMSNorm and SiLU-gated MLP of the decoder layers (`_fusable`) through
    `longctx.ops.pointwise`: one kernel each way on a GPU, and less kept for the backward (the norm keeps its input and
    one float32 scale a row, where transformers' keeps a float32 copy of the rows; the gate keeps its two inputs,
    not its activation). The same values (computed in float32, rounded once)."""
    for layer in layers:
        norms, mlps = _fusable(layer)
        for m in norms:
            m.forward = types.MethodType(_norm_forward, m)
        for m in mlps:
            m.forward = types.MethodType(_mlp_forward, m)


def _patch_mlp_chunks(layers: nn.ModuleList, chunk: int) -> None:
    """The MLP of every layer over chunks of ``chunk`` tokens in training, each chunk checkpointed (recomputed in
    the backward): its (tokens, ffn) intermediates exist for one chunk at a time (the GPT's
    ``sequence_chunk_size``); position-wise, so the output is the same."""
    for layer in layers:
        mlp = layer.mlp
        whole = mlp.forward

        def forward(x: torch.Tensor, *args: Any, _whole=whole, _mlp=mlp, **kwargs: Any) -> torch.Tensor:
            if args or kwargs:
                return _whole(x, *args, **kwargs)
            return run_in_chunks(_whole, x, chunk, _mlp)  # (B, S, h)

        mlp.forward = forward


def _patch_layers(
    layers: nn.ModuleList, chunks: list, offloader: ActivationOffloader | None, offload_layers: int
) -> None:
    """Megatron-semantics recomputation on transformers' layer loop: the first layer of a checkpointed chunk runs
    the whole chunk under a checkpoint, the others of the chunk pass the hidden states through (in training with
    autograd recording; otherwise every layer runs as it was)."""
    for c in chunks:
        if not c.checkpointed:
            continue
        members = [layers[i] for i in range(c.start, c.end)]
        for layer in members:
            if not hasattr(layer, "_longctx_forward"):
                layer._longctx_forward = layer.forward
        head = members[0]

        def head_forward(self, hidden_states, *args, _c=c, _members=members, **kwargs):
            if not recompute_active(self):
                return self._longctx_forward(hidden_states, *args, **kwargs)
            if _c.end - _c.start > 1 and _collecting("hidden_states"):
                raise ValueError(
                    "output_hidden_states cannot report the layers inside a recomputed chunk of "
                    f"{_c.end - _c.start} layers; use recompute_num_layers=1 (or method 'block') to collect them"
                )
            # the KV cache is for generation: a recomputed layer would write it twice (transformers' own
            # gradient checkpointing drops it the same way)
            kwargs = {**kwargs, "use_cache": False, "past_key_values": None} if "past_key_values" in kwargs else kwargs

            def run(h: torch.Tensor) -> torch.Tensor:
                for m in _members:
                    h = _check_output(m._longctx_forward(h, *args, **kwargs), m)
                return h

            if offloader is None:
                return checkpoint_call(run, hidden_states)
            grads = [n for n, t in kwargs.items() if isinstance(t, torch.Tensor) and t.requires_grad]
            grads += [n for n, t in kwargs.items() if isinstance(t, tuple) and any(
                isinstance(x, torch.Tensor) and x.requires_grad for x in t)]  # fmt: skip
            if grads or any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
                raise ValueError(
                    "cpu_offloading and recompute_skip_core_attention need layer inputs other than the hidden states "
                    f"without gradients, got {grads}"
                )
            if _c.start == 0:
                offloader.begin()
            return offloaded_checkpoint(run, offloader, _c.end <= offload_layers, hidden_states)

        def pass_forward(self, hidden_states, *args, **kwargs):
            if recompute_active(self):
                return hidden_states  # computed by the chunk's first layer
            return self._longctx_forward(hidden_states, *args, **kwargs)

        head.forward = types.MethodType(head_forward, head)
        for layer in members[1:]:
            layer.forward = types.MethodType(pass_forward, layer)


def _shift_labels(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]  # (B, S): token t predicts labels[t + 1]


def _token_loss_sum(model: nn.Module, hidden: torch.Tensor, shift: torch.Tensor, fused: bool) -> torch.Tensor:
    head = model.get_output_embeddings()
    if fused:
        return linear_cross_entropy(hidden, head.weight, shift, bias=head.bias, reduction="sum")
    logits = head(hidden).float()  # (B, S, V)
    return F.cross_entropy(logits.flatten(0, 1), shift.flatten(), ignore_index=-100, reduction="sum")


def _patch_forward(model: nn.Module, *, fused_loss: bool, cp: ContextParallel | None) -> None:
    original = model.forward
    base = _decoder(model)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Any = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Any,
    ):
        shift = kwargs.pop("shift_labels", None)
        num_items = kwargs.pop("num_items_in_batch", None)
        return_dict = kwargs.pop("return_dict", True)
        if cp is None and labels is None and shift is None:
            return original(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                logits_to_keep=logits_to_keep, return_dict=return_dict, **kwargs,
            )  # fmt: skip
        if shift is None and labels is not None:
            shift = _shift_labels(labels)
        if cp is not None:
            varlen = {k: kwargs.pop(k) for k in _VARLEN_KEYS if k in kwargs}  # this rank's tokens are others
            input_ids, inputs_embeds, position_ids, shift = _cp_inputs(
                cp, input_ids, inputs_embeds, attention_mask, position_ids, past_key_values, shift, varlen
            )
            attention_mask, use_cache = None, False
        outputs = base(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs,
        )  # fmt: skip
        hidden = outputs.last_hidden_state  # (B, S, h), this rank's S/P under context parallelism
        loss, logits = None, None
        if shift is None:  # context parallelism without labels: this rank's logits
            logits = self.get_output_embeddings()(hidden)
        else:
            local_sum = _token_loss_sum(self, hidden, shift, fused_loss)
            if cp is not None:
                loss = _cp_loss(cp, local_sum, shift, num_items)
            elif num_items is not None:
                loss = local_sum / torch.as_tensor(num_items, device=local_sum.device)
            else:
                loss = local_sum / (shift != -100).sum()
        out = CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )
        return out if return_dict else out.to_tuple()

    model.forward = types.MethodType(forward, model)


_VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def _cp_inputs(
    cp: ContextParallel,
    input_ids: torch.Tensor | None,
    inputs_embeds: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    past_key_values: Any,
    shift: torch.Tensor | None,
    varlen: dict[str, Any],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """This rank's shard of the full-batch inputs and shifted labels, and its positions.

    One sequence per row: the zigzag shard of every row, with global positions. Packed documents (position ids
    that restart, or the flattening collator's cu_seq_lens): the rows packed end to end and dealt by the dispatcher
    (`longctx.distributed.dispatch_plan`: documents whole where they fit, balanced by mask area), each tensor
    (1, B S / P) with positions inside the documents; the plan stays on ``cp`` (``_packed_plan``) for the layers'
    attention, and for their recomputation in the backward, until the next forward."""
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError(
            "context parallelism shards one unpadded sequence per row: got an attention_mask with padding; pack "
            "or trim the batch to full rows"
        )
    if past_key_values is not None:
        raise ValueError("context parallelism is for training: pass past_key_values=None")
    full = input_ids if input_ids is not None else inputs_embeds
    B, S = full.shape[:2]
    meta = _varlen_kwargs(varlen)
    if meta is None and position_ids is None:
        cp._packed_plan = None
        cp.check_seq_len(S)
        pos = cp.position_ids(S, device=full.device).unsqueeze(0).expand(B, -1)  # (B, S/P)
        return cp.shard(input_ids), cp.shard(inputs_embeds), pos, cp.shard(shift)
    from longctx.distributed.dispatch import dispatch_plan
    from longctx.masks.packing import document_positions, packed_cu_seqlens

    if meta is not None:  # the collator's documents, over the rows packed end to end
        if meta.cu_q.tolist() != meta.cu_k.tolist() or int(meta.cu_q[-1]) != B * S:
            raise ValueError(
                "context parallelism over packed documents needs cu_seq_lens_q == cu_seq_lens_k covering the batch's "
                f"{B * S} tokens (DataCollatorWithFlattening's), got {meta.cu_q.tolist()} and {meta.cu_k.tolist()}"
            )
        starts = torch.zeros(B * S, dtype=torch.bool, device=full.device)
        starts[meta.cu_q[:-1].long().to(full.device)] = True
        starts = starts.view(B, S)
    else:
        starts = position_ids.expand(B, S) == 0  # the documents start where the positions restart
    pos = document_positions(starts)  # (B, S)
    plan = dispatch_plan(packed_cu_seqlens(starts).tolist(), group=cp.group, causal=True)
    cp._packed_plan = plan

    def local(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else plan.dispatch(t.reshape(B * S, *t.shape[2:])).unsqueeze(0)

    return local(input_ids), local(inputs_embeds), local(pos), local(shift)


def _cp_loss(cp: ContextParallel, local_sum: torch.Tensor, shift: torch.Tensor, num_items: Any) -> torch.Tensor:
    """This rank's share of the global mean, whose value is the global mean itself (for logging)."""
    if num_items is None:
        share, mean = cp.share_of_mean(local_sum, (shift != -100).sum())
    else:  # the Trainer's count of the labels over the (full, identical on every rank) batch
        denom = torch.as_tensor(num_items, device=local_sum.device).to(local_sum.dtype)
        share = local_sum / denom
        total = local_sum.detach().clone()
        if cp.world > 1:
            info = group_info(cp.group)
            total = total.to(comm_device(info, local_sum))
            torch.distributed.all_reduce(total, group=cp.group)
        mean = total.to(local_sum.device) / denom
    return share + (mean.to(share.dtype) - share).detach()


def apply(
    model: nn.Module,
    *,
    recompute_granularity: str | None = None,
    recompute_method: str | None = None,
    recompute_num_layers: int | None = None,
    cpu_offloading: bool = False,
    cpu_offloading_num_layers: int | None = None,
    recompute_skip_core_attention: bool = False,
    sequence_chunk_size: int | None = None,
    fused_loss: bool = True,
    context_parallel_group: Any = None,
    context_parallel_method: str = "auto",
    context_parallel_layout: str = "zigzag",
    context_parallel_backend: str = "auto",
    offload_params: bool = False,
    mesh: Any = None,
    offload_resident_units: int = 0,
) -> nn.Module:
    """Put longctx into a transformers causal LM, in place (Liger-Kernel's ``apply_liger_kernel_to_*`` idea).

    The model may be wrapped by PEFT (``get_peft_model(model, LoraConfig(...))``): longctx goes into the causal LM
    inside, the adapters stay where PEFT put them (only they train; the frozen base is neither copied nor given
    gradients).

    - attention: switched to ``attn_implementation="longctx"``;
    - the Llama-form RMSNorms and SiLU-gated MLPs (`LLAMA_NORMS`, `LLAMA_MLPS`) through `longctx.ops.pointwise`'s
      fused kernels (``LONGCTX_FUSED_POINTWISE=0``: torch's ops);
    - recomputation with Megatron's semantics (`longctx.layers.recompute`) over the decoder layers: "full" with
      "uniform" (chunks of ``recompute_num_layers`` layers, each keeping only its input) or "block" (the first
      ``recompute_num_layers`` layers); "selective" places nothing (longctx's attention already recomputes its
      scores in the backward);
    - ``cpu_offloading``: the inputs the recomputed chunks keep go to pinned host memory (the first
      ``cpu_offloading_num_layers`` layers, default all), as `longctx.GPT` does;
    - ``recompute_skip_core_attention`` (with full recomputation): the forward of each recomputed layer keeps its
      attention output and log-sum-exp, and the layer's recomputation in the backward reads them back, so attention
      runs one forward and one backward a step (`longctx.layers.attention.kept_causal_attention`, as the GPT's
      option of that name). It costs one (B, S, Hq D) output in the attention's dtype and one (B, Hq, S) float32
      lse per recomputed layer, on the device. Kept where that is exact: causal attention over one sequence
      (GQA included), no window shorter than the sequence, no logit softcap. A call with padding, packed documents
      (cu_seq_lens or restarting position ids), a shorter sliding window or a softcap recomputes its attention as
      without the option (Gemma 2's full-attention layers keep, its sliding ones recompute);
    - ``sequence_chunk_size``: each layer's MLP over chunks of that many tokens in training, each recomputed in the
      backward (the GPT's setting of that name): one chunk's (tokens, ffn) intermediates at a time;
    - ``fused_loss``: with ``labels``, the loss comes from the hidden states through `longctx.linear_cross_entropy`
      without the (tokens, vocab) logits; the output's ``logits`` is then None. Same value as transformers'
      ForCausalLMLoss (mean over counted tokens, or the sum over ``num_items_in_batch`` as the Trainer passes);
    - context parallelism (``context_parallel_group``): every rank calls the model with the same full batch
      (B, S); the model shards input ids, labels and positions (``context_parallel_layout``, zigzag by default),
      runs `longctx.distributed.cp_attention` in every layer, and returns a loss whose value is the global mean
      and whose gradient is this rank's share: call `allreduce_gradients(model)` after ``backward`` to get the
      single-process gradients. Without labels it returns this rank's logits (B, S/P, V). Packed batches
      (DataCollatorWithFlattening: cu_seq_lens, or position ids that restart) are packed end to end and dealt by
      `longctx.distributed.dispatch_plan` (documents whole where they fit, balanced by mask area; causal, no
      sliding window), ``context_parallel_method`` running over the plan;
    - ``offload_params``: the parameters, their gradients and the optimizer's states in host memory, sharded by FSDP2
      over ``mesh`` (`longctx.distributed.offload`; None: this process alone): build the optimizer after ``apply``,
      on the host (`longctx.distributed.offload.host_adamw`; with ``max_grad_norm=`` and ``overlap=True`` it clips on
      every core and steps behind the next forward, as ``longctx train`` does: give transformers' Trainer
      ``max_grad_norm=0`` then, torch's clipping of host gradients runs on one core; ``save_pretrained`` writes whole
      tensors and loading a whole checkpoint fills the shards, so the Trainer's checkpoints save and resume in one
      process). With context parallelism, ``mesh`` is ``init_mesh(dp, cp)`` and ``context_parallel_group`` its
      "cp" group: FSDP2 then sums the gradients over both and `allreduce_gradients` has nothing to do.

    Args:
        model: a causal LM of the Llama family (``model.model.layers``).
        recompute_granularity, recompute_method, recompute_num_layers: as in Megatron (see
            `longctx.layers.recompute`).
        cpu_offloading, cpu_offloading_num_layers: activation offloading of fully recomputed layers.
        recompute_skip_core_attention: keep attention's output for the recomputation (full recomputation only).
        sequence_chunk_size: tokens per chunk of each layer's MLP in training (None: whole).
        fused_loss: the logits-free loss (models in `FUSED_LOSS_MODELS`).
        context_parallel_group: a process group (or the default world when the ``torch.distributed`` world is the
            group: pass ``torch.distributed.group.WORLD``); None for no context parallelism.
        context_parallel_method: "ring", "allgather", "ulysses" or "auto" (the default: "ulysses" where the heads
            split over the group, the fastest measured on packed batches and on par on one sequence, else "ring").
            context_parallel_layout: "zigzag" or "contiguous". context_parallel_backend: "auto", "tiled" or
            "triton".
        offload_params: parameters, gradients and optimizer states in host memory (FSDP2's CPU offload).
        mesh: the ("dp", "cp") DeviceMesh of `longctx.distributed.init_mesh` the offloaded states are sharded over
            (with ``offload_params`` only).
        offload_resident_units: with ``offload_params``, how many units keep their states on the GPU, in the order
            the forward gathers them: the root (``lm_head`` and the final norm), the input embedding, then the first
            decoder layers (`longctx.distributed.mesh.apply_fsdp`; `longctx.plan` says how many fit).

    Returns:
        The same model.

    Raises:
        ValueError / TypeError: invalid recompute settings (Megatron's rules), offloading or kept attention without
            full recomputation, kept attention with attention dropout or context parallelism, transformers' own
            gradient checkpointing left on, fused_loss on a model whose loss is not `lm_head` + cross-entropy (e.g.
            final logit softcapping), a model that is not a causal LM of the Llama family, or attention dropout with
            context parallelism.
    """
    wrapper = model
    if callable(getattr(model, "get_base_model", None)):  # PEFT's PeftModel: longctx goes into the causal LM inside
        model = model.get_base_model()
    if any(getattr(m, "_longctx_applied", False) for m in (wrapper, model)):
        raise ValueError("apply was already called on this model; build a fresh model to change the settings")
    base = _decoder(model)
    layers = base.layers
    cfg = model.config
    if not isinstance(offload_params, bool):
        raise TypeError(f"offload_params must be True or False, got {offload_params!r}")
    if mesh is not None and not offload_params:
        raise ValueError("mesh is where offload_params shards the states: pass offload_params=True, or no mesh")
    if isinstance(offload_resident_units, bool) or not isinstance(offload_resident_units, int):
        raise TypeError(f"offload_resident_units must be an int, got {offload_resident_units!r}")
    if offload_resident_units and not offload_params:
        raise ValueError(
            f"offload_resident_units={offload_resident_units} keeps units of offloaded states on the GPU: pass "
            "offload_params=True too"
        )
    if offload_params and context_parallel_group is not None and mesh is None:
        raise ValueError(
            "offload_params with context parallelism shards the states over the data x context parallel ranks: pass "
            "mesh=init_mesh(dp, cp) and its cp group (longctx.distributed.cp_group(mesh)) as context_parallel_group"
        )
    if getattr(model, "is_gradient_checkpointing", False) and recompute_granularity is not None:
        raise ValueError(
            "transformers' gradient checkpointing is on (gradient_checkpointing_enable() or TrainingArguments("
            "gradient_checkpointing=True)); turn it off when apply places longctx's recomputation"
        )
    chunks = plan_layers(recompute_granularity, recompute_method, recompute_num_layers, len(layers))
    if not isinstance(cpu_offloading, bool) or not isinstance(fused_loss, bool):
        raise TypeError(f"cpu_offloading and fused_loss must be bools, got {cpu_offloading!r}, {fused_loss!r}")
    if cpu_offloading and recompute_granularity != "full":
        raise ValueError(
            "cpu_offloading moves the inputs of fully recomputed layers to host memory: set "
            f"recompute_granularity='full' (got {recompute_granularity!r})"
        )
    keep = recompute_skip_core_attention
    if not isinstance(keep, bool):
        raise TypeError(f"recompute_skip_core_attention must be True or False, got {keep!r}")
    dropout = getattr(cfg, "attention_dropout", 0.0) or 0.0
    if keep and (recompute_granularity != "full" or dropout > 0):
        raise ValueError(
            "recompute_skip_core_attention keeps the attention output of fully recomputed layers: it needs "
            f"recompute_granularity='full' (got {recompute_granularity!r}) and config.attention_dropout == 0 (got "
            f"{dropout}); pass recompute_granularity='full' with recompute_method and recompute_num_layers, or "
            "recompute_skip_core_attention=False"
        )
    if keep and context_parallel_group is not None:
        raise ValueError(
            "recompute_skip_core_attention keeps the attention of one device, but context parallelism runs "
            "cp_attention across the group (recomputed in the backward): pass recompute_skip_core_attention=False "
            "with context_parallel_group"
        )
    if keep and any(not isinstance(getattr(layer, "self_attn", None), nn.Module) for layer in layers):
        raise TypeError(
            "recompute_skip_core_attention keeps each layer's attention, but this model's layers have no `self_attn` "
            "module; pass recompute_skip_core_attention=False"
        )
    chunk = sequence_chunk_size
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"sequence_chunk_size must be a positive int or None, got {chunk!r}")
    if chunk is not None and any(not isinstance(getattr(layer, "mlp", None), nn.Module) for layer in layers):
        raise TypeError(
            "sequence_chunk_size runs each layer's MLP in chunks of tokens, but this model's layers have no `mlp` "
            "module; pass sequence_chunk_size=None"
        )
    n_off = len(layers) if cpu_offloading_num_layers is None else cpu_offloading_num_layers
    if isinstance(n_off, bool) or not isinstance(n_off, int) or not 1 <= n_off <= len(layers):
        raise ValueError(
            f"cpu_offloading_num_layers must be an int in [1, {len(layers)}] or None, got {cpu_offloading_num_layers!r}"
        )
    if fused_loss:
        name = type(model).__name__
        if name not in FUSED_LOSS_MODELS:
            raise ValueError(
                f"fused_loss=True computes the loss of {', '.join(FUSED_LOSS_MODELS)} without logits; {name} may "
                "transform its logits before the loss: pass fused_loss=False"
            )
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if head is not None and hasattr(head, "lora_A"):
            raise ValueError(
                "the logits-free loss reads lm_head's weight, but PEFT put an adapter on lm_head: leave lm_head out of "
                "the adapter's target_modules, or pass fused_loss=False"
            )
        softcap = getattr(cfg, "final_logit_softcapping", None)
        if softcap is not None:
            raise ValueError(
                f"{name} caps its logits (config.final_logit_softcapping={softcap}), which the logits-free loss does "
                "not implement: pass fused_loss=False, or set final_logit_softcapping=None"
            )
    cp = None
    if context_parallel_group is not None:
        if getattr(cfg, "attention_dropout", 0.0):
            raise ValueError("context parallelism needs config.attention_dropout == 0")
        group = None if context_parallel_group is torch.distributed.group.WORLD else context_parallel_group
        heads, kv_heads = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        if context_parallel_method == "auto":
            from longctx.distributed.comm import cp_group_info
            from longctx.distributed.ulysses import splits_heads

            world = cp_group_info(group, "apply(context_parallel_group=...)").world
            context_parallel_method = "ulysses" if splits_heads(heads, kv_heads, world) else "ring"
        cp = ContextParallel(
            group=group,
            method=context_parallel_method,
            layout=context_parallel_layout,
            backend=context_parallel_backend,
        )
        if context_parallel_method == "ulysses":
            from longctx.distributed.ulysses import kv_replication

            kv_replication(heads, kv_heads, cp.world)
        for layer in layers:
            layer.self_attn._longctx_context_parallel = cp
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    else:  # pragma: no cover - transformers without set_attn_implementation
        cfg._attn_implementation = ATTN_IMPLEMENTATION
    # the chunks run through OffloadedCheckpoint (their inputs on the device unless offloaded) when their layers
    # keep results for the recomputation
    offloader = ActivationOffloader() if cpu_offloading or keep else None
    for c in chunks if keep else ():
        if c.checkpointed:
            for layer in layers[c.start : c.end]:
                layer.self_attn._longctx_keep_attention = True
    _patch_pointwise(layers)
    if sequence_chunk_size is not None:
        _patch_mlp_chunks(layers, sequence_chunk_size)  # over the fused MLP
    _patch_layers(layers, chunks, offloader, n_off if cpu_offloading else 0)
    if fused_loss or cp is not None:
        _patch_forward(model, fused_loss=fused_loss, cp=cp)
    if offload_params:
        from longctx.distributed.offload import offload_model

        _patch_save_pretrained(model, wrapper, offload_model(model, mesh, resident_units=offload_resident_units))
    for m in {id(model): model, id(wrapper): wrapper}.values():
        m._longctx_applied = True
        m._longctx_context_parallel = None if offload_params else cp  # offloaded: FSDP2 summed over dp x cp
    return wrapper


def _whole(t: Any) -> torch.Tensor:
    """The whole tensor of a DTensor held by one rank: its local shard where that is all of it (no copy)."""
    local = t.to_local()
    return local if local.shape == t.shape else t.full_tensor()


def _patch_save_pretrained(model: nn.Module, wrapper: nn.Module, mesh: Any) -> None:
    """``save_pretrained`` of an offloaded model, and of the PEFT model around it (its adapters), writes whole
    tensors (safetensors cannot hold FSDP2's DTensor shards; transformers' Trainer saves checkpoints through it). In
    one process the shards are the whole tensors, taken without a copy; over several ranks the Trainer saves on one
    rank only, where gathering would wait for the others forever, so it raises instead, naming what to do."""

    def patch(target: nn.Module) -> None:
        plain = target.save_pretrained

        def save_pretrained(*args: Any, state_dict: dict | None = None, **kwargs: Any) -> Any:
            sd = target.state_dict() if state_dict is None else state_dict
            if any(hasattr(v, "full_tensor") for v in sd.values()):
                if mesh.size() > 1:
                    raise ValueError(
                        f"save_pretrained of a model whose states are offloaded over {mesh.size()} ranks: its weights "
                        "are shards on every rank. Save with torch.distributed.checkpoint on every rank "
                        "(longctx.training.checkpoint.save_sharded_state), or gather them on every rank with "
                        "torch.distributed.checkpoint.state_dict.get_model_state_dict(model, "
                        "options=StateDictOptions(full_state_dict=True)) and pass state_dict= on the first"
                    )
                sd = {k: _whole(v) if hasattr(v, "full_tensor") else v for k, v in sd.items()}
            return plain(*args, state_dict=sd, **kwargs)

        target.save_pretrained = save_pretrained

    for target in {id(model): model, id(wrapper): wrapper}.values():
        patch(target)

    def whole_to_shards(module: nn.Module, state_dict: dict, prefix: str, *_: Any) -> None:
        # whole tensors (a save_pretrained checkpoint) into the DTensor shards: each rank keeps its own shard
        from torch.distributed.tensor import distribute_tensor

        for name, p in [*module.named_parameters(), *module.named_buffers()]:
            v = state_dict.get(prefix + name)
            if hasattr(p, "device_mesh") and isinstance(v, torch.Tensor) and not hasattr(v, "device_mesh"):
                state_dict[prefix + name] = distribute_tensor(v, p.device_mesh, p.placements, src_data_rank=None)

    model.register_load_state_dict_pre_hook(whole_to_shards)


def allreduce_gradients(model: nn.Module) -> None:
    """Sum the parameter gradients over the context-parallel group of a model `apply` set up for it (after
    ``loss.backward()``, before the optimizer step); nothing without context parallelism."""
    cp = getattr(model, "_longctx_context_parallel", None)
    if cp is not None:
        cp.allreduce_gradients(model)
