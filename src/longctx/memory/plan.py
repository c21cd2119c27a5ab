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
from longctx.memory.model import StepMemory, kept_bytes, step_memory, step_segments
from longctx.models.gpt import GPTConfig
from longctx.units import count_arg, parse_bytes

__all__ = ["Plan", "plan", "parse_bytes", "format_plan", "describe"]

# Rates used to compare plans (not to predict absolute step time): bf16 matmuls, the flash attention forward and
# backward, and host <-> device copies over PCIe, on the H100.
_MATMUL_FLOPS = 600e12
_ATTN_FWD_FLOPS = 450e12
_ATTN_BWD_FLOPS = 400e12
_PCIE_BYTES = 20e9
_PLAN_FIELDS = (
    "recompute_granularity",
    "recompute_method",
    "recompute_num_layers",
    "recompute_skip_core_attention",
    "sequence_chunk_size",
    "cpu_offloading",
    "cpu_offloading_num_layers",
)


@dataclass(frozen=True)
class Plan:
    """A plan: the config with its memory settings, the predicted memory, and the predicted added cost."""

    config: GPTConfig
    memory: StepMemory
    recompute_seconds: float  # predicted time the plan adds to a step without recomputation
    budget: int

    @property
    def settings(self) -> dict:
        """The plan's settings, by their GPTConfig names (``plan.settings``: a dict, e.g. for a config file)."""
        return {k: getattr(self.config, k) for k in _PLAN_FIELDS}

    def describe(self) -> str:
        return describe(self.config)


def describe(c: GPTConfig) -> str:
    """One line naming a config's memory settings."""
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
    return ", ".join(parts)


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


def _candidates(config: GPTConfig, S: int) -> list[GPTConfig]:
    L = config.num_layers
    base = {k: None for k in ("recompute_granularity", "recompute_method", "recompute_num_layers")}
    base.update(recompute_skip_core_attention=False, sequence_chunk_size=None, cpu_offloading=False,
                cpu_offloading_num_layers=None)  # fmt: skip
    full1 = dict(base, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    chunks = [c for c in (16384, 8192, 4096, 2048) if c < S]
    out = [base]
    for n in sorted({max(1, L // 4), max(1, L // 2), max(1, 3 * L // 4)}):
        for skip in (False, True):
            out.append(dict(base, recompute_granularity="full", recompute_method="block", recompute_num_layers=n,
                            recompute_skip_core_attention=skip))  # fmt: skip
    for skip in (False, True):
        out.append(dict(full1, recompute_skip_core_attention=skip))
        for ch in chunks:
            out.append(dict(full1, recompute_skip_core_attention=skip, sequence_chunk_size=ch))
    for n in sorted({max(1, L // 4), max(1, L // 2), max(1, 3 * L // 4), L}):
        for ch in [None, *chunks[-2:]]:
            out.append(dict(full1, sequence_chunk_size=ch, cpu_offloading=True, cpu_offloading_num_layers=n))
    return [dataclasses.replace(config, **kw) for kw in out]


def _kept_lower_bound(c: GPTConfig, B: int, S: int) -> int:
    """Bytes a plan keeps on the device for sure: its checkpoints (float32 residual) and kept attention outputs."""
    if c.recompute_granularity != "full":
        return 0
    n = c.recompute_num_layers if c.recompute_method == "block" else c.num_layers
    on_device = n - ((c.cpu_offloading_num_layers or c.num_layers) if c.cpu_offloading else 0)
    kept = n * B * S * c.num_attention_heads * (2 * c.head_dim + 4) if c.recompute_skip_core_attention else 0
    return max(0, on_device) * B * S * c.hidden_size * 4 + kept


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

    def __init__(self, config: GPTConfig, S: int, B: int) -> None:
        cands = _candidates(config, S)
        self.none, self.uniform = cands[0], next(c for c in cands if c.recompute_method == "uniform")
        self.config, self.S, self.B = config, S, B
        self._refs: tuple | None = None

    def _references(self) -> tuple:
        if self._refs is None:
            n_mem, n_seg = step_segments(self.none, seq_length=self.S, micro_batch_size=self.B)
            u_mem, u_seg = step_segments(self.uniform, seq_length=self.S, micro_batch_size=self.B)
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


def _frugal(config: GPTConfig, S: int) -> GPTConfig:
    return _candidates(config, S)[-1]


def plan(
    config: GPTConfig,
    *,
    seq_length: int,
    budget: str | int | float,
    micro_batch_size: int = 1,
) -> Plan:
    """The plan that fits ``budget`` at the least predicted recompute cost.

    Args:
        config: the model; its own memory settings are ignored (the plan chooses them).
        seq_length: tokens per sequence.
        budget: GPU memory for the step, e.g. "40GiB" or bytes.
        micro_batch_size: sequences per step.

    Returns:
        A `Plan` whose ``config`` is ``config`` at ``seq_length`` with the chosen settings: ``GPT(plan.config)``
        trains at the planned length.

    Raises:
        ValueError: a budget below the parameters and optimizer states, or no plan fits (the message gives the
            minimum budget for this length and the longest length that fits this budget).
    """
    limit = parse_bytes(budget)
    if not isinstance(config, GPTConfig):
        raise TypeError(f"config must be a GPTConfig, got {type(config).__name__}")
    S, B = seq_length, micro_batch_size
    cands = sorted(_candidates(config, S), key=lambda c: _added_seconds(c, B, S))
    n_params, param_bytes = _num_parameters(config)
    static = 2 * param_bytes + 8 * n_params  # parameters and their gradients, AdamW's two fp32 states
    if limit < static:
        raise ValueError(
            f"budget {limit / 2**30:.2f} GiB is below the parameters, gradients and optimizer states alone "
            f"({static / 2**30:.2f} GiB for {n_params:,} parameters in fp32 with AdamW)"
        )
    # cheapest first; the first that fits is the plan, so the plans after it (the frugal ones, whose traces are the
    # longest: many sequence chunks) are not traced. Where only offloading plans can fit, the most frugal one is
    # traced first: if it does not fit, none does.
    # Every other candidate is traced only if its lower bound (`_PeakBound`: the loss segment's bytes, from the
    # traces of two plans) fits: the walk is in cost order and stops at the first that fits, so a plan that costs
    # more than a fitting one is never traced.
    cands = [c for c in cands if static + _kept_lower_bound(c, B, S) <= limit]  # the others' checkpoints do not fit
    frugal = _frugal(config, S)
    frugal_mem = None
    if all(c.cpu_offloading for c in cands):
        frugal_mem = step_memory(frugal, seq_length=S, micro_batch_size=B)
        cands = cands if frugal_mem.total <= limit else []
    bound = _PeakBound(config, S, B)
    for cand in cands:
        if cand != bound.none:
            low = bound.lower(cand)
            if low is not None and low > limit:
                continue
        mem = step_memory(cand, seq_length=S, micro_batch_size=B)
        if mem.total <= limit:  # the config that trains at the planned length
            return Plan(dataclasses.replace(cand, seq_length=S), mem, _added_seconds(cand, B, S), limit)
    frugal_mem = frugal_mem or step_memory(frugal, seq_length=S, micro_batch_size=B)
    longest = _longest_fitting(config, limit, B)
    raise ValueError(
        f"no plan trains S={S:,} in {limit / 2**30:.2f} GiB: the most frugal one ({describe(frugal)}) "
        f"needs {frugal_mem.total / 2**30:.2f} GiB; the longest sequence this budget trains is about "
        f"{longest:,} tokens"
    )


def _num_parameters(config: GPTConfig) -> tuple[int, int]:
    """The parameters of ``GPT(config)`` and their bytes, counted on a model without storage."""
    import torch

    from longctx.models.gpt import GPT

    with torch.device("meta"):
        params = list(GPT(config).parameters())
    return sum(p.numel() for p in params), sum(p.numel() * p.element_size() for p in params)


def _longest_fitting(config: GPTConfig, limit: int, B: int) -> int:
    """The longest S (a multiple of 1024) whose most frugal plan fits ``limit``, 0 if none."""
    lo, hi = 0, 1024
    while step_memory(_frugal(config, hi), seq_length=hi, micro_batch_size=B).total <= limit and hi < (1 << 26):
        lo, hi = hi, hi * 2
    while hi - lo > 1024:
        mid = (lo + hi) // 2 // 1024 * 1024
        if step_memory(_frugal(config, mid), seq_length=mid, micro_batch_size=B).total <= limit:
            lo = mid
        else:
            hi = mid
    return lo


def format_plan(p: Plan) -> str:
    """The plan as a table: settings, then the predicted peak broken down."""
    m = p.memory
    lines = [
        f"plan for S={m.seq_length:,}, micro batch {m.micro_batch_size}, budget {p.budget / 2**30:.2f} GiB:",
        f"  {p.describe()}",
        "",
        "| setting | value |",
        "|---|---|",
    ]
    lines += [f"| {k} | {v} |" for k, v in p.settings.items()]
    lines += ["", "| predicted peak | GiB |", "|---|---|"]
    lines += [f"| {name} | {b / 2**30:.2f} |" for name, b in m.rows()]
    lines.append(f"| **total** | **{m.total / 2**30:.2f}** |")
    if m.host_offloaded:
        lines.append(f"| (pinned host memory for offloaded checkpoints) | {m.host_offloaded / 2**30:.2f} |")
    lines.append("")
    lines.append(
        f"predicted recompute cost: {p.recompute_seconds:.3f} s per step added to a step without recomputation"
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
        "of GPU memory, and where its bytes go; --json FILE also writes its settings (the input of longctx bench "
        "memory --plans and of a config file).",
        epilog="example: longctx plan --preset llama-350m --seq-length 131072 --budget 40GiB",
    )
    ap.add_argument("--preset", default="llama-350m", choices=sorted(PRESETS), help="the model shape")
    ap.add_argument("--seq-length", type=count_arg("--seq-length", 1), required=True,
                    help="tokens per sequence (e.g. 131072 or 1.3e5)")  # fmt: skip
    ap.add_argument("--budget", required=True, help="GPU memory for a training step, with its unit, e.g. 40GiB")
    ap.add_argument("--micro-batch-size", type=count_arg("--micro-batch-size", 1), default=1,
                    help="sequences per step (default 1)")  # fmt: skip
    ap.add_argument("--json", default=None, help="also write {S: {settings, predicted_bytes}} to this file")
    args = ap.parse_args(argv)
    try:
        p = plan(GPTConfig.preset(args.preset), seq_length=args.seq_length, budget=args.budget,
                 micro_batch_size=args.micro_batch_size)  # fmt: skip
    except (ValueError, TypeError) as e:
        print(f"longctx plan: {e}", file=sys.stderr)
        return 2
    print(format_plan(p))
    if args.json:
        out = {str(args.seq_length): {"budget": args.budget, "settings": p.settings, "predicted_bytes": p.memory.total}}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0
