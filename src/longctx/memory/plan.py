"""The planner: the recompute / chunking / offloading settings that fit a memory budget at the least recompute cost.

`plan(config, seq_length=S, budget="40GiB")` walks candidate plans from the cheapest in predicted step time to the
most frugal in memory, predicts each one's peak with the memory model (`longctx.memory.model.step_memory`, a counted
trace of the real step) and returns the first that fits, with its breakdown. Candidates:

    none                       keep every activation (no recompute)
    full, block n              checkpoint the first n layers, keep the others' activations
    full, uniform 1            checkpoint every layer's input
    + skip core attention      keep each layer's attention output and lse: its recompute skips attention
    + sequence chunks          the norm + MLP of a layer in chunks of tokens, each recomputed in the backward
    + cpu offloading n         the first n layers' checkpoints in pinned host memory

Predicted cost is counted in FLOPs of the work each plan adds to a step without recomputation (a recomputed layer's
forward, its attention unless kept, the MLP again under sequence chunking, the replayed chunk's last linear), at
the H100's matmul and attention rates, plus the part of the offloading copies that the layer compute cannot hide.
An impossible request raises ValueError with the minimum budget for that S and the longest S that fits the budget.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from longctx.layers.recompute import plan_layers
from longctx.memory.model import (
    HOST_OVERHEAD_BYTES,
    LORA_TARGETS,
    PLAN_FIELDS,
    StepMemory,
    check_lora,
    kept_bytes,
    lora_parameters,
    offloaded_state_bytes,
    parameter_shapes,
    resident_shard_elements,
    resident_split,
    resident_units_of,
    step_memory,
    step_segments,
    units_in_flight,
)
from longctx.models.gpt import GPTConfig
from longctx.units import count_arg, parse_bytes

__all__ = ["Plan", "plan", "parse_bytes", "format_plan", "describe", "parameter_count"]

# Rates used to compare plans (not to predict absolute step time): bf16 matmuls, the flash attention forward and
# backward, and host <-> device copies over PCIe, on the H100.
_MATMUL_FLOPS = 600e12
_ATTN_FWD_FLOPS = 450e12
_ATTN_BWD_FLOPS = 400e12
_PCIE_BYTES = 20e9
# The fused CPU AdamW of offloaded states: it reads and writes about 28 bytes a parameter (weight, gradient, two
# states; weight and states written back), at about this host memory bandwidth.
_HOST_ADAM_BYTES = 40e9


@dataclass(frozen=True)
class Plan:
    """A plan: the config with its memory settings, the predicted memory, and the predicted added cost."""

    config: GPTConfig
    memory: StepMemory
    recompute_seconds: float  # predicted time the plan adds to a step without recomputation (and offloading)
    budget: int
    offload_params: bool = False  # parameters, gradients and AdamW states in host memory
    host_budget: int | None = None  # None: the host memory was not bounded
    data_parallel: int = 1
    context_parallel: int = 1
    lora_rank: int | None = None  # a LoRA run: adapters of this rank on lora_targets, the base frozen
    lora_targets: tuple[str, ...] = LORA_TARGETS
    cp_method: str = "ring"  # the context-parallel method planned (context_parallel > 1)
    resident_units: int = 0  # offload_params: units whose states stay on the GPU (`apply_fsdp`)

    @property
    def binds(self) -> str:
        """The memory the plan is closest to filling: ``"GPU"`` or ``"host"``."""
        if self.host_budget is None:
            return "GPU"
        return "host" if self.memory.host_total / self.host_budget > self.memory.total / self.budget else "GPU"

    @property
    def settings(self) -> dict:
        """The plan's settings, by their GPTConfig names (``plan.settings``: a dict, e.g. for a config file)."""
        return {k: getattr(self.config, k) for k in PLAN_FIELDS}

    def describe(self) -> str:
        text = describe(self.config, self.offload_params, self.resident_units)
        if self.lora_rank is not None:
            text += f", LoRA rank {self.lora_rank} on {', '.join(self.lora_targets)} (base frozen in bf16)"
        return text


def describe(c: GPTConfig, offload_params: bool = False, resident_units: int = 0) -> str:
    """One line naming a config's memory settings (and ``offload_params``, with its ``resident_units``)."""
    if c.recompute_granularity is None:
        parts = ["no recompute"]
    else:
        parts = [f"recompute {c.recompute_granularity} {c.recompute_method} {c.recompute_num_layers}"]
    if c.recompute_skip_core_attention:
        parts.append("skip core attention in recompute")
    if c.sequence_chunk_size:
        parts.append(f"sequence chunks of {c.sequence_chunk_size}")
    if c.cpu_offloading:
        parts.append(f"cpu offloading of {c.cpu_offloading_num_layers or c.num_layers} layers")
    if offload_params and resident_units == resident_units_of(c):
        parts.append("parameters, gradients and optimizer states on the GPU, sharded by FSDP2 (every unit resident)")
    elif offload_params:
        parts.append("parameters, gradients and optimizer states in host memory")
        if resident_units:
            parts[-1] += f" but for {resident_text(c, resident_units)} ({resident_units} units on the GPU)"
    return ", ".join(parts)


def resident_text(c: GPTConfig, resident_units: int) -> str:
    """What ``resident_units`` keeps on the GPU, in words ("the output layer, the embedding, 3 layers")."""
    if not resident_units:
        return "none"
    _, embedding, layers = resident_split(c, resident_units)
    tied = c.share_embeddings_and_output_weights
    kept = ["the output layer" + (" and the tied embedding" if tied else "")]
    kept += ["the embedding"] if embedding and not tied else []
    kept += [f"{layers} layer{'s' if layers > 1 else ''}"] if layers else []
    return ", ".join(kept)


def _layer_flops(c: GPTConfig, B: int, S: int) -> tuple[float, float, float, float]:
    """(linear, MLP, last linear, attention) forward FLOPs of one layer."""
    h, D, Hq, Hkv, F = c.hidden_size, c.head_dim, c.num_attention_heads, c.kv_heads, c.ffn_size
    qkv = 2 * B * S * h * (Hq + 2 * Hkv) * D
    proj = 2 * B * S * Hq * D * h
    mlp = 2 * B * S * h * 2 * F + 2 * B * S * F * h
    attn = 4 * B * S * S * Hq * D * 0.5  # causal
    return qkv + proj + mlp, mlp, 2 * B * S * F * h, attn


def _added_seconds(c: GPTConfig, B: int, S: int) -> float:
    lin, mlp, last, attn = _layer_flops(c, B, S)
    layer_seconds = (3 * lin) / _MATMUL_FLOPS + attn / _ATTN_FWD_FLOPS + 2.5 * attn / _ATTN_BWD_FLOPS
    t = 0.0
    if c.recompute_granularity == "full":
        n = c.recompute_num_layers if c.recompute_method == "block" else c.num_layers
        per = lin / _MATMUL_FLOPS + (0.0 if c.recompute_skip_core_attention else attn / _ATTN_FWD_FLOPS)
        if c.cpu_offloading or c.recompute_skip_core_attention:
            per += last / _MATMUL_FLOPS  # the replayed chunk recomputes its last linear too
        t += n * per
        if c.sequence_chunk_size and c.sequence_chunk_size < S:
            t += c.num_layers * mlp / _MATMUL_FLOPS
        if c.cpu_offloading:
            copy = 2 * B * S * c.hidden_size * 4 / _PCIE_BYTES  # to the host and back, float32 residual
            t += (c.cpu_offloading_num_layers or c.num_layers) * max(0.0, copy - layer_seconds)
    elif c.sequence_chunk_size and c.sequence_chunk_size < S:
        t += c.num_layers * mlp / _MATMUL_FLOPS
    return t


def _step_seconds(c: GPTConfig, B: int, S: int) -> float:
    """A step's compute without recomputation (forward and backward of every layer)."""
    lin, _, _, attn = _layer_flops(c, B, S)
    return c.num_layers * ((3 * lin) / _MATMUL_FLOPS + attn / _ATTN_FWD_FLOPS + 2.5 * attn / _ATTN_BWD_FLOPS)


def _offload_seconds(c: GPTConfig, n_params: int, shards: int, B: int, S: int) -> float:
    """What offloading the states of ``n_params`` parameters adds to a step: the CPU AdamW step, and the copies the
    compute cannot hide (FSDP2 copies each unit's fp32 shard to the GPU three times: forward, recomputation,
    backward; and its fp32 gradients back once). Resident units are not counted in ``n_params``: their copies and
    step are the GPU's."""
    n = n_params / shards
    copies = 16 * n / _PCIE_BYTES
    return 28 * n / _HOST_ADAM_BYTES + max(0.0, copies - _step_seconds(c, B, S))


def _candidates(config: GPTConfig, S: int, context_parallel: int = 1) -> list[GPTConfig]:
    """The plans tried, cheapest first within each kind; the last is the most frugal. Under context parallelism
    without kept attention outputs (they do not apply there: `model.check_context_parallel`)."""
    L = config.num_layers
    skips = (False,) if context_parallel > 1 else (False, True)
    base = {k: None for k in ("recompute_granularity", "recompute_method", "recompute_num_layers")}
    base.update(recompute_skip_core_attention=False, sequence_chunk_size=None, cpu_offloading=False,
                cpu_offloading_num_layers=None)  # fmt: skip
    full1 = dict(base, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    chunks = [c for c in (16384, 8192, 4096, 2048) if c < S]
    out = [base]
    for n in sorted({max(1, L // 4), max(1, L // 2), max(1, 3 * L // 4)}):
        for skip in skips:
            out.append(dict(base, recompute_granularity="full", recompute_method="block", recompute_num_layers=n,
                            recompute_skip_core_attention=skip))  # fmt: skip
    for skip in skips:
        out.append(dict(full1, recompute_skip_core_attention=skip))
        for ch in chunks:
            out.append(dict(full1, recompute_skip_core_attention=skip, sequence_chunk_size=ch))
    for n in sorted({max(1, L // 4), max(1, L // 2), max(1, 3 * L // 4), L}):
        for ch in [None, *chunks[-2:]]:
            out.append(dict(full1, sequence_chunk_size=ch, cpu_offloading=True, cpu_offloading_num_layers=n))
    return [dataclasses.replace(config, **kw) for kw in out]


def _kept_lower_bound(c: GPTConfig, B: int, S: int, resid_bytes: int = 4) -> int:
    """Bytes a plan keeps on the device for sure: its checkpoints (the residual stream: float32, or bf16 under
    offload_params' mixed precision) and kept attention outputs."""
    if c.recompute_granularity != "full":
        return 0
    n = c.recompute_num_layers if c.recompute_method == "block" else c.num_layers
    on_device = n - ((c.cpu_offloading_num_layers or c.num_layers) if c.cpu_offloading else 0)
    kept = n * B * S * c.num_attention_heads * (2 * c.head_dim + 4) if c.recompute_skip_core_attention else 0
    return max(0, on_device) * B * S * c.hidden_size * resid_bytes + kept


class _PeakBound:
    """A lower bound on a candidate's predicted peak without its trace, from two traced plans of the same length:
    no recompute (N) and full uniform recompute (U, nothing kept, nothing offloaded).

    The predicted peak is at least the top of the step's "loss" segment (the loss's working set, after the whole
    forward). There the forward has left, from each layer, what that layer keeps for its backward: its activations
    if not recomputed (a bytes), its checkpoint (the residual stream, r bytes) if checkpointed on the device,
    nothing of that if offloaded; kept attention outputs wherever they are kept; and the same bytes besides in
    every plan (autocast's low-precision weights, the final hidden state, the loss's chunk). The layers are
    identical, so ``loss(U) = R + L r`` and ``loss(N) = R + L a``, and a plan with w layers kept whole and o
    checkpoints offloaded has ``loss = loss(U) + w (loss(N) - loss(U)) / L - o r + kept``, less 1 MiB of slack
    (the bytes of the two references are read at S like the plan's own). Checked against every candidate's
    prediction on small models (`tests/unit/test_memory_bound.py`).
    """

    SLACK = 1 << 20

    def __init__(self, config: GPTConfig, S: int, B: int, **memory_kw) -> None:
        cands = _candidates(config, S, memory_kw.get("context_parallel", 1))
        self.none, self.uniform = cands[0], next(c for c in cands if c.recompute_method == "uniform")
        self.config, self.S, self.B = config, S, B
        self.memory_kw = memory_kw  # offload_params, shards: as the plans' own predictions
        self._refs: tuple | None = None

    def _references(self) -> tuple:
        if self._refs is None:
            n_mem, n_seg = step_segments(self.none, seq_length=self.S, micro_batch_size=self.B, **self.memory_kw)
            u_mem, u_seg = step_segments(self.uniform, seq_length=self.S, micro_batch_size=self.B, **self.memory_kw)
            r = u_mem.checkpoints // self.config.num_layers  # one layer's checkpoint: the residual stream
            fixed = u_mem.parameters + u_mem.optimizer_states + u_mem.overhead
            self._refs = (fixed, n_seg["loss"], u_seg["loss"], r)
        return self._refs

    def lower(self, c: GPTConfig) -> int | None:
        """A number <= ``step_memory(c).total`` (None where ``c`` is not a plan of the shape above)."""
        chunks = plan_layers(c.recompute_granularity, c.recompute_method, c.recompute_num_layers, c.num_layers)
        if any(ch.end - ch.start != 1 for ch in chunks):
            return None
        fixed, loss_n, loss_u, r = self._references()
        L = c.num_layers
        whole = sum(not ch.checkpointed for ch in chunks)
        resid = r // (self.B * self.S * c.hidden_size)
        _, kept, host = kept_bytes(c, self.S, self.B, resid, step_memory.__kwdefaults__["autocast_dtype"])
        offloaded = host // r if r else 0
        loss = loss_u + whole * (loss_n - loss_u) // L - offloaded * r + kept
        return fixed + loss - self.SLACK


def _frugal(config: GPTConfig, S: int, context_parallel: int = 1) -> GPTConfig:
    return _candidates(config, S, context_parallel)[-1]


def _tradeoffs(config: GPTConfig, S: int, context_parallel: int = 1) -> list[GPTConfig]:
    """The candidates with the smallest sequence chunks (the least GPU memory for their offloading), from none of
    the checkpoints offloaded to all of them: each offloaded layer moves its checkpoint from the GPU to the host."""
    cands = _candidates(config, S, context_parallel)
    least = min((c.sequence_chunk_size or S) for c in cands)
    return [c for c in cands if c.recompute_method == "uniform" and not c.recompute_skip_core_attention
            and (c.sequence_chunk_size or S) == least]  # fmt: skip


def plan(
    config: GPTConfig,
    *,
    seq_length: int,
    budget: str | int | float,
    micro_batch_size: int = 1,
    host_budget: str | int | float | None = None,
    data_parallel: int = 1,
    context_parallel: int = 1,
    offload_params: bool | None = None,
    lora_rank: int | None = None,
    lora_targets: tuple[str, ...] | list[str] = LORA_TARGETS,
    cp_method: str = "ring",
    resident_units: int | None = None,
) -> Plan:
    """The plan that fits ``budget`` (and ``host_budget``) at the least predicted added cost.

    Args:
        config: the model; its own memory settings are ignored (the plan chooses them).
        seq_length: tokens per sequence (the whole sequence: under context parallelism each rank holds
            ``seq_length / context_parallel`` of them).
        budget: GPU memory for the step, e.g. "40GiB" or bytes (per GPU).
        micro_batch_size: sequences per step (per data-parallel rank).
        host_budget: host memory the step may use, for every rank of the machine together (offloaded states and
            checkpoints, and each process's own); None does not bound it (the plan still predicts it).
        data_parallel, context_parallel: the ranks; offloaded states are sharded over all of them, and each rank
            runs ``seq_length / context_parallel`` tokens with ``cp_method``'s attention (its own buffers traced:
            `model.step_memory`; no kept attention outputs under context parallelism).
        cp_method: the context-parallel method ("ring", "allgather", "ulysses"; "p2p" and "ulysses_ring" are
            planned as the ring).
        offload_params: True: parameters, gradients and AdamW states in host memory (`longctx.distributed.offload`);
            False: on the GPU; None: the plan chooses, offloading them only where no plan with them on the GPU
            fits (its CPU optimizer step and copies cost seconds a step: `_offload_seconds`).
        lora_rank, lora_targets: a LoRA fine-tuning run (PEFT's adapters of this rank on these linears, by their
            transformers names): the base frozen in bf16 on the GPU (no gradients, no optimizer states), the float32
            adapters trained (`longctx.memory.model.step_memory`).
        resident_units: with offloaded states, how many units keep theirs on the GPU (`apply_fsdp`: the output
            layer, the embedding, the first layers); None: the plan chooses the most that fit the GPU's budget
            beside the plan's activations, and at least as many as the host's budget needs. Each resident unit
            takes its copies and its optimizer step off the host's critical path.

    Returns:
        A `Plan` whose ``config`` is ``config`` at ``seq_length`` with the chosen settings: ``GPT(plan.config)``
        trains at the planned length, with ``plan.offload_params`` and ``plan.resident_units``.

    Raises:
        ValueError: no plan fits; the message says which memory is short and by how much (the most frugal plan's
            predicted GPU and host peaks against the budgets) and the longest length that fits.
    """
    limit = parse_bytes(budget, "budget")
    host_limit = None if host_budget is None else parse_bytes(host_budget, "host_budget")
    if not isinstance(config, GPTConfig):
        raise TypeError(f"config must be a GPTConfig, got {type(config).__name__}")
    for name, value in (("data_parallel", data_parallel), ("context_parallel", context_parallel)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if offload_params not in (None, True, False):
        raise TypeError(f"offload_params must be True, False or None (the plan chooses), got {offload_params!r}")
    if seq_length % context_parallel:
        raise ValueError(
            f"seq_length {seq_length:,} is not divisible by context_parallel={context_parallel}: each rank holds "
            f"seq_length / context_parallel tokens; pass a multiple of {context_parallel}"
        )
    lora_targets = tuple(lora_targets)
    check_lora(lora_rank, lora_targets)
    if lora_rank is not None and offload_params:
        raise ValueError("offload_params with lora_rank is not planned: a LoRA run's frozen bf16 base stays on the GPU")
    if resident_units is not None:
        resident_split(config, resident_units)  # a count the model has
        if offload_params is not True:
            raise ValueError(f"resident_units={resident_units} keeps units of offloaded states on the GPU: pass "
                             "offload_params=True (or leave resident_units to the plan)")  # fmt: skip
    ranks = data_parallel * context_parallel
    S, B = seq_length // context_parallel, micro_batch_size
    n_params, _ = parameter_count(config)
    modes = [False] if lora_rank is not None else [False, True] if offload_params is None else [offload_params]
    lora = dict(lora_rank=lora_rank, lora_targets=lora_targets) if lora_rank is not None else {}
    # every (plan, mode) in order of predicted added time, the modes in turn; the first that fits both memories wins
    walk: list[tuple[float, int, GPTConfig, bool]] = []
    for off in modes:
        for i, c in enumerate(_candidates(config, S, context_parallel)):
            cost = _added_seconds(c, B, S) + (_offload_seconds(c, n_params, ranks, B, S) if off else 0.0)
            walk.append((cost, i, c, off))
    walk.sort(key=lambda t: (t[3], t[0], t[1]))  # plans with the states on the GPU first: offloading is the fallback
    cp_kw = dict(context_parallel=context_parallel, cp_method=cp_method) if context_parallel > 1 else {}
    kw_of = {off: dict(offload_params=off, shards=ranks, **cp_kw) if off else dict(lora, **cp_kw) for off in modes}
    bounds = {off: _PeakBound(config, S, B, **kw_of[off]) for off in modes}
    best: tuple[float, int, GPTConfig, StepMemory, float] | None = None  # offloaded: (cost, units, plan, memory, ..)
    for cost, _, cand, off in walk:
        if best is not None and _added_seconds(cand, B, S) >= best[0]:
            break  # offloaded plans come last, in order of added time: none after this one can cost less
        # the host's units resident on the GPU: the fewest the host's budget needs (or the ones asked for)
        k = 0
        if off:
            fixed = resident_units
            k = fixed if fixed is not None else _fewest_resident(cand, ranks, B, S, host_limit)
            if k is None:
                continue
        # the checkpoints and the states a plan keeps on the GPU for sure: plans that cannot fit are not traced
        extra = _resident_held(cand, k, ranks) if off else 0
        if _held_for_sure(cand, off, ranks, lora_rank, lora_targets, B, S) + extra > limit:
            continue
        if host_limit is not None and host_need(cand, off, ranks, B, S, k) > host_limit:
            continue  # the host side is known without a trace
        if cand != bounds[off].none:
            low = bounds[off].lower(cand)
            if low is not None and low + extra > limit:
                continue
        resident = {"resident_units": k} if off else {}
        mem = step_memory(cand, seq_length=S, micro_batch_size=B, **kw_of[off], **resident)
        if mem.total > limit or (host_limit is not None and _host_per_machine(mem, ranks) > host_limit):
            continue
        if not off:
            return Plan(dataclasses.replace(cand, seq_length=seq_length), mem, cost, limit, off, host_limit,
                        data_parallel, context_parallel, lora_rank, lora_targets, cp_method)  # fmt: skip
        if resident_units is None:  # as many more as the GPU's budget holds: each takes work off the host
            k, mem = _most_resident(cand, k, mem, limit, S, B, kw_of[off])
        n_off = n_params - ranks * sum(_resident_elements(cand, k, ranks))
        total = _added_seconds(cand, B, S) + _offload_seconds(cand, n_off, ranks, B, S)
        if best is None or total < best[0]:
            best = (total, k, cand, mem, cost)
    if best is not None:
        total, k, cand, mem, _ = best
        return Plan(dataclasses.replace(cand, seq_length=seq_length), mem, total, limit, True, host_limit,
                    data_parallel, context_parallel, lora_rank, lora_targets, cp_method, resident_units=k)  # fmt: skip
    frugal = _frugal(config, S, context_parallel)
    off = modes[-1]
    k = 0  # offloaded: the resident units the host's budget needs (all of them where it needs more)
    if off:
        k = resident_units if resident_units is not None else _fewest_resident(frugal, ranks, B, S, host_limit)
        k = resident_units_of(frugal) if k is None else k
    frugal_mem = step_memory(
        frugal, seq_length=S, micro_batch_size=B, **kw_of[off], **({"resident_units": k} if off else {})
    )
    short = [f"GPU {frugal_mem.total / 2**30:.2f} GiB (budget {limit / 2**30:.2f} GiB)"]
    host_frugal = _host_per_machine(frugal_mem, ranks)
    if host_limit is not None:
        short.append(f"host {host_frugal / 2**30:.2f} GiB (budget {host_limit / 2**30:.2f} GiB)")
    missing = [
        f"{name} is short by {(need - have) / 2**30:.2f} GiB"
        for name, need, have in (("GPU", frugal_mem.total, limit), ("host", host_frugal, host_limit))
        if have is not None and need > have
    ]
    longest = max(_longest_fitting(config, limit, B, host_limit, kw_of[m], ranks, context_parallel) for m in modes)
    where = f" per GPU of {ranks} ranks" if ranks > 1 else ""
    batch = f" in micro batches of {B} sequences" if B > 1 else ""
    raise ValueError(
        f"no plan trains S={seq_length:,}{batch} in {limit / 2**30:.2f} GiB{where}: the most frugal one "
        f"({describe(frugal, off, k)}) needs {', '.join(short)}; {'; '.join(missing) or 'it does not fit'}. "
        + (f"The longest sequence these budgets train is about {longest:,} tokens" if longest else
           "No length fits these budgets")
        + ("" if off or lora_rank is not None else "; offload_params (parameters in host memory) may train longer")
        + (f"; a micro batch of fewer than {B} sequences (micro_batch_size, --batch-size) needs less" if B > 1 else "")
    )  # fmt: skip


def _held_for_sure(c: GPTConfig, off: bool, ranks: int, lora_rank: int | None, lora_targets, B: int, S: int) -> int:
    """Bytes plan ``c`` keeps on the GPU for sure, without a trace: the states (or the units in flight, offloaded)
    and its checkpoints and kept attention outputs."""
    n_params, param_bytes = parameter_count(c)
    if off:
        counts = _layer_counts(c)
        static = units_in_flight(counts[0], counts[1], ranks, 2)
    elif lora_rank is not None:  # the frozen bf16 base; the adapters, their gradients and AdamW's states
        static = 2 * n_params + 16 * lora_parameters(c, lora_rank, lora_targets)
    else:
        static = 2 * param_bytes + 8 * n_params  # parameters and their gradients, AdamW's two fp32 states
    return static + _kept_lower_bound(c, B, S, 2 if off or lora_rank is not None else 4)


def _resident_elements(c: GPTConfig, k: int, ranks: int) -> tuple[int, int, int]:
    """One rank's elements of the resident units: (output layer, embedding, all resident layers)."""
    root, embedding, layer = resident_shard_elements(c, k, ranks)
    return root, embedding, layer * resident_split(c, k)[2]


def _resident_held(c: GPTConfig, k: int, ranks: int) -> int:
    """GPU bytes ``k`` resident units hold for the whole step: fp32 weights and AdamW's two states."""
    return 12 * sum(_resident_elements(c, k, ranks))


def _fewest_resident(c: GPTConfig, ranks: int, B: int, S: int, host_limit: int | None) -> int | None:
    """The fewest resident units whose plan ``c`` fits the host's budget (0 without one), None if none does."""
    if host_limit is None:
        return 0
    return next((k for k in range(resident_units_of(c) + 1) if host_need(c, True, ranks, B, S, k) <= host_limit),
                None)  # fmt: skip


def _most_resident(c: GPTConfig, k: int, mem: StepMemory, limit: int, S: int, B: int, kw: dict
                   ) -> tuple[int, StepMemory]:  # fmt: skip
    """The most resident units (from ``k``, which fits with ``mem``) whose predicted GPU peak fits ``limit``: the
    peak grows with each unit, so a bisection; each step reuses the plan's trace."""
    lo, hi = k, resident_units_of(c)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        m = step_memory(c, seq_length=S, micro_batch_size=B, **kw, resident_units=mid)
        if m.total <= limit:
            lo, mem = mid, m
        else:
            hi = mid - 1
    return lo, mem


def host_need(c: GPTConfig, offload_params: bool, ranks: int, B: int, S: int, resident_units: int = 0) -> int:
    """A plan's host bytes, every rank of the host together, without its trace (what `step_memory` puts there:
    the offloaded states but the ``resident_units``', the offloaded checkpoints, the process); ``S`` is each
    rank's tokens."""
    _, _, checkpoints = kept_bytes(c, S, B, 2 if offload_params else 4, step_memory.__kwdefaults__["autocast_dtype"])
    states = offloaded_state_bytes(c, ranks, resident_units=resident_units) if offload_params else 0
    return ranks * (states + checkpoints + HOST_OVERHEAD_BYTES)


def _host_per_machine(mem: StepMemory, ranks: int) -> int:
    """Host bytes of every rank together (the ranks of one host share its memory)."""
    return ranks * mem.host_total


def _layer_counts(config: GPTConfig) -> tuple[int, int]:
    """(parameters of one layer, parameters outside the sharded units: the final norm and the output projection,
    or the embedding when it is tied to it), counted on a model without storage."""
    ps = parameter_shapes(config)
    tied = ps.count(ps.embedding) if config.share_embeddings_and_output_weights else 0
    return ps.count(ps.layer), ps.count(ps.others) + tied


def parameter_count(config: GPTConfig) -> tuple[int, int]:
    """The parameters of ``GPT(config)`` and their bytes, counted on a model without storage."""
    return parameter_shapes(config).total()


def _longest_fitting(
    config: GPTConfig,
    limit: int,
    B: int,
    host_limit: int | None = None,
    memory_kw: dict | None = None,
    ranks: int = 1,
    context_parallel: int = 1,
) -> int:
    """The longest S (a multiple of 1024 x context_parallel) that a frugal plan fits in ``limit`` and the host
    limit, 0 if none. Without a host limit the most frugal plan (every checkpoint offloaded) fits longest; with one,
    offloading checkpoints trades GPU memory for host memory, so the plans that offload fewer layers (`_tradeoffs`)
    may fit where the most frugal one's host side does not; with offloaded states, the units whose states the host
    cannot hold stay on the GPU (`_fewest_resident`)."""
    memory_kw = memory_kw or {}
    offload = bool(memory_kw.get("offload_params"))
    lora_rank, lora_targets = memory_kw.get("lora_rank"), memory_kw.get("lora_targets", LORA_TARGETS)

    def fits(s: int) -> bool:
        # those the host takes (its side is known without a trace), the most offloaded first: it usually holds the
        # least on the GPU (not always: offloading a layer or two can cost more than it moves)
        for c in reversed(
            _tradeoffs(config, s, context_parallel)
            if host_limit is not None
            else [_frugal(config, s, context_parallel)]
        ):
            k = _fewest_resident(c, ranks, B, s, host_limit) if offload else 0  # what the host cannot hold
            if k is None or (host_limit is not None and host_need(c, offload, ranks, B, s, k) > host_limit):
                continue
            if _held_for_sure(c, offload, ranks, lora_rank, lora_targets, B, s) + _resident_held(c, k, ranks) > limit:
                continue
            mem = step_memory(c, seq_length=s, micro_batch_size=B, **memory_kw, **({"resident_units": k} if k else {}))
            if mem.total <= limit and (host_limit is None or _host_per_machine(mem, ranks) <= host_limit):
                return True
        return False

    lo, hi = 0, 1024
    while fits(hi) and hi < (1 << 26):
        lo, hi = hi, hi * 2
    while hi - lo > 1024:
        mid = (lo + hi) // 2 // 1024 * 1024
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo * context_parallel


def format_plan(p: Plan) -> str:
    """The plan as a table: settings, then the predicted peak broken down."""
    m = p.memory
    ranks = p.data_parallel * p.context_parallel
    layout = ""
    if ranks > 1:
        cp = f" ({p.cp_method})" if p.context_parallel > 1 else ""
        layout = (f", per rank of data parallel {p.data_parallel} x context parallel {p.context_parallel}{cp} "
                  f"({m.seq_length:,} tokens a rank)")  # fmt: skip
    host = "unbounded" if p.host_budget is None else f"{p.host_budget / 2**30:.2f} GiB"
    lines = [
        f"plan for S={p.config.seq_length:,}, micro batch {m.micro_batch_size}, budget {p.budget / 2**30:.2f} GiB "
        f"GPU, {host} host{layout}:",
        f"  {p.describe()}",
        "",
        "| setting | value |",
        "|---|---|",
    ]
    lines += [f"| {k} | {v} |" for k, v in p.settings.items()]
    lines.append(f"| offload_params | {p.offload_params} |")
    if p.offload_params:
        lines.append(f"| resident_units | {p.resident_units} ({resident_text(p.config, p.resident_units)}) |")
    lines += ["", "| predicted GPU peak | GiB |", "|---|---|"]
    lines += [f"| {name} | {b / 2**30:.2f} |" for name, b in m.rows()]
    lines.append(f"| **total** | **{m.total / 2**30:.2f}** |")
    lines += ["", "| predicted host peak | GiB |", "|---|---|"]
    if m.offload_params:
        lines.append(f"| fp32 parameters, gradients, AdamW states (this rank's shard) | {m.host_states / 2**30:.2f} |")
    lines.append(f"| offloaded checkpoints (pinned) | {m.host_offloaded / 2**30:.2f} |")
    lines.append(f"| the process (CUDA context, libraries) | {m.host_overhead / 2**30:.2f} |")
    lines.append(f"| **total** | **{m.host_total / 2**30:.2f}** |")
    if ranks > 1:
        lines.append(f"| **every rank of the host** | **{ranks * m.host_total / 2**30:.2f}** |")
    lines.append("")
    gpu_share = m.total / p.budget
    host_share = "" if p.host_budget is None else f", host {ranks * m.host_total / p.host_budget:.0%}"
    lines.append(f"binds: {p.binds} (GPU {gpu_share:.0%} of its budget{host_share})")
    lines.append(
        f"predicted added cost: {p.recompute_seconds:.3f} s per step over a step without recomputation"
        + (" (and the CPU optimizer step and host copies)" if p.offload_params else "")
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``longctx plan --preset llama-350m --seq-length 131072 --budget 40GiB``: print the plan (``--json FILE`` also
    writes its settings, the input of ``longctx bench memory --plans`` and of a config file)."""
    import argparse
    import json
    import sys

    from longctx.models.gpt import PRESETS

    ap = argparse.ArgumentParser(
        prog="longctx plan",
        description="Print the recompute / chunking / offloading plan that trains a preset at --seq-length in --budget "
        "of GPU memory (and --host-budget of host memory), where the bytes of both go and which memory binds; --json "
        "FILE also writes its settings (the input of longctx bench memory --plans and of a config file).",
        epilog="examples: longctx plan --preset llama-350m --seq-length 131072 --budget 40GiB; longctx plan --preset "
        "llama-8b --seq-length 524288 --budget 78GiB --host-budget 400GiB",
    )
    ap.add_argument("--preset", default="llama-350m", choices=sorted(PRESETS), help="the model shape")
    ap.add_argument("--seq-length", type=count_arg("--seq-length", 1), required=True,
                    help="tokens per sequence (e.g. 131072 or 1.3e5)")  # fmt: skip
    ap.add_argument("--budget", required=True, help="GPU memory for a training step, with its unit, e.g. 40GiB")
    ap.add_argument("--micro-batch-size", type=count_arg("--micro-batch-size", 1), default=1,
                    help="sequences per step (default 1)")  # fmt: skip
    ap.add_argument("--host-budget", default=None,
                    help="host memory the step may use, every rank of the host together, e.g. 400GiB (default: not "
                    "bounded; the plan still predicts it)")  # fmt: skip
    ap.add_argument("--data-parallel", type=count_arg("--data-parallel", 1), default=1,
                    help="data-parallel ranks (offloaded states are sharded over every rank)")  # fmt: skip
    ap.add_argument("--context-parallel", type=count_arg("--context-parallel", 1), default=1,
                    help="context-parallel ranks: each holds seq-length / context-parallel tokens")  # fmt: skip
    ap.add_argument("--cp-method", choices=("ring", "allgather", "ulysses", "ulysses_ring", "p2p"), default="ring",
                    help="the context-parallel method whose buffers the plan counts (p2p and ulysses_ring are "
                    "planned as the ring; default ring)")  # fmt: skip
    ap.add_argument("--offload-params", choices=("auto", "on", "off"), default="auto",
                    help="parameters, gradients and AdamW states in host memory: auto lets the plan choose "
                    "(default auto)")  # fmt: skip
    ap.add_argument("--resident-units", type=int, default=None,
                    help="with offloaded states: how many units keep theirs on the GPU (the output layer, the "
                    "embedding, then the first layers); default: the most that fit --budget")  # fmt: skip
    ap.add_argument("--lora-rank", type=count_arg("--lora-rank", 1), default=None,
                    help="plan a LoRA fine-tuning run: adapters of this rank, the base frozen in bf16")  # fmt: skip
    ap.add_argument("--lora-targets", default=",".join(LORA_TARGETS),
                    help="the adapted linears, by transformers' names (default: all of them)")  # fmt: skip
    ap.add_argument("--json", default=None, help="also write {S: {settings, predicted_bytes}} to this file")
    args = ap.parse_args(argv)
    offload = {"auto": None, "on": True, "off": False}[args.offload_params]
    try:
        p = plan(GPTConfig.preset(args.preset), seq_length=args.seq_length, budget=args.budget,
                 micro_batch_size=args.micro_batch_size, host_budget=args.host_budget,
                 data_parallel=args.data_parallel, context_parallel=args.context_parallel,
                 offload_params=offload, lora_rank=args.lora_rank, cp_method=args.cp_method,
                 resident_units=args.resident_units,
                 lora_targets=tuple(t.strip() for t in args.lora_targets.split(",") if t.strip()))  # fmt: skip
    except (ValueError, TypeError) as e:
        print(f"longctx plan: {e}", file=sys.stderr)
        return 2
    print(format_plan(p))
    if args.json:
        out = {str(args.seq_length): {"budget": args.budget, "settings": p.settings, "offload_params": p.offload_params,
                                      "resident_units": p.resident_units,
                                      "predicted_bytes": p.memory.total,
                                      "predicted_host_bytes": p.memory.host_total}}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0
