"""Parameters, gradients and optimizer states in host memory: a model larger than its GPU, on FSDP2.

An 8B model's fp32 weights, gradients and AdamW states are 16 bytes a parameter, 128 GB: more than one GPU holds.
With ``offload_params`` FSDP2's CPU offload policy keeps this rank's shard of them in pinned host memory; each unit
(a decoder layer, the embedding) is copied to the GPU in bfloat16 when it runs, the next one's copy in flight
behind the current one's compute, and its gradients go back to the host after its backward; the AdamW step runs on
the CPU (torch's fused CPU kernel) on the fp32 master weights. The GPU holds the activations and the few units in
flight.

    mesh = offload_model(model)                      # one process: a one-rank mesh; under torchrun pass init_mesh's
    optimizer = host_adamw(model, lr=3e-4)           # after sharding: the parameters are host DTensors
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(tokens, labels=tokens)          # tokens on the GPU
    loss.backward()
    optimizer.step(); optimizer.zero_grad()

The host's part of a step is on the GPU's critical path; two things shorten it (`longctx train` uses both):
`host_grad_norm` takes the gradient norm on every core of the rank's share (torch's norm of a CPU tensor runs on
about one), and `OverlappedHostStep` takes the AdamW step behind the next step's forward.

`longctx train --offload-params` and `integrations.transformers.apply(model, offload_params=True)` call these; the
planner (`longctx.memory.plan`, ``host_budget``) predicts both memories. `HostPeak` measures the host side.

The host's work of a step (the AdamW step, the gradient norm over host shards) runs on this process's share of the
host's cores (`host_threads`): torchrun starts every rank with one intra-op thread (``OMP_NUM_THREADS=1``), which
would leave an 8B model's CPU step on one core a rank.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import math
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = [
    "offload_model",
    "host_adamw",
    "HostAdamW",
    "OverlappedHostStep",
    "host_grad_norm",
    "clip_scale",
    "host_threads",
    "host_thread_share",
    "step_on_host_threads",
    "build_device",
    "HostPeak",
    "host_rss",
]


def offload_model(
    model: nn.Module,
    mesh: Any = None,
    *,
    param_dtype: torch.dtype | str | None = "auto",
    units: list[nn.Module] | None = None,
    resident_units: int = 0,
) -> Any:
    """Shard ``model`` with FSDP2's CPU offload policy (`longctx.distributed.mesh.apply_fsdp`), in place; returns
    the mesh.

    Args:
        model: a longctx GPT or a transformers causal LM (see `decoder_units`), on the CPU (its units are copied to
            the GPU one by one) or on the GPU.
        mesh: the ("dp", "cp") mesh of `init_mesh`; None for one process (a one-rank mesh on the GPU if there is
            one).
        param_dtype: the dtype the units compute in (bfloat16: the copies and the GPU's weights are halved); None
            computes in the parameters' dtype; "auto": bfloat16 on a GPU, None on the CPU (nothing to gain there).
        units: the modules sharded one by one (default `decoder_units`).
        resident_units: how many units keep their states on the GPU, in the order the forward gathers them (the
            root, then ``units``): see `longctx.distributed.mesh.apply_fsdp`.
    """
    from longctx.distributed.mesh import apply_fsdp, decoder_units, init_mesh

    if mesh is None:
        mesh = init_mesh(1, 1)
    if param_dtype == "auto":
        param_dtype = torch.bfloat16 if mesh.device_type == "cuda" else None
    apply_fsdp(model, mesh, offload_params=True, param_dtype=param_dtype,
               units=decoder_units(model) if units is None else units, resident_units=resident_units)  # fmt: skip
    return mesh


def unit_parameters(model: nn.Module, units: list[nn.Module] | None = None) -> list[list[nn.Parameter]]:
    """The parameters of each unit of an offloaded model, in the order the forward gathers them: the root's own
    (what no unit holds), then each of ``units`` (default `decoder_units`)."""
    from longctx.distributed.mesh import decoder_units

    units = decoder_units(model) if units is None else list(units)
    in_units = {id(p) for u in units for p in u.parameters()}
    return [[p for p in model.parameters() if id(p) not in in_units], *[list(u.parameters()) for u in units]]


def resident_parameters(model: nn.Module, units: list[nn.Module] | None = None) -> set[int]:
    """The ids of the parameters whose states `apply_fsdp`'s ``resident_units`` kept on the GPU."""
    k = getattr(model, "_longctx_resident_units", 0)
    return {id(p) for ps in unit_parameters(model, units)[:k] for p in ps} if k else set()


def host_adamw(
    model: nn.Module,
    lr: float,
    *,
    betas: tuple[float, float] = (0.9, 0.95),
    weight_decay: float = 0.1,
    max_grad_norm: float | None = None,
    overlap: bool = False,
) -> torch.optim.AdamW:
    """AdamW on the host for an offloaded model: torch's fused CPU kernel over the fp32 master weights, weight decay
    on matrices only; only parameters that train (``requires_grad``, e.g. LoRA adapters) get states.

    With ``max_grad_norm`` or ``overlap`` it is a `HostAdamW`, whose ``step()`` takes the host's part of a step as
    ``longctx train`` does, for a loop of one's own or transformers' Trainer (pass it ``max_grad_norm=0`` there:
    torch's clipping of host gradients runs on about one core): the gradient norm on the host's cores
    (`host_grad_norm`), the clipping to ``max_grad_norm``, and, with ``overlap``, the step behind the next forward
    (`OverlappedHostStep`).

    Raises:
        ValueError: a parameter that is not in host memory (call `offload_model` first), or a ``max_grad_norm``
            that is not positive.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    resident = resident_parameters(model)
    on_gpu = [p for p in params if p.device.type != "cpu" and id(p) not in resident]
    if on_gpu:
        raise ValueError(
            f"host_adamw steps parameters in host memory, but {len(on_gpu)} of them are on {on_gpu[0].device}: "
            "shard the model with offload_model (or apply_fsdp(..., offload_params=True)) first"
        )
    if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float)) and max_grad_norm > 0):
        raise ValueError(f"max_grad_norm must be a positive number or None (no clipping), got {max_grad_norm!r}")
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    if max_grad_norm is None and not overlap:
        return step_on_host_threads(torch.optim.AdamW(groups, lr=lr, betas=betas, fused=True))
    return step_on_host_threads(HostAdamW(groups, model, lr=lr, betas=betas, max_grad_norm=max_grad_norm,
                                          overlap=overlap))  # fmt: skip


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the same storage), a plain tensor itself."""
    if hasattr(t, "to_local"):
        with torch.no_grad():
            return t.to_local()
    return t


def host_grad_norm(parameters: Any, chunk: int = 1 << 23) -> torch.Tensor:
    """The 2-norm of the gradients of ``parameters`` held in host memory (offloaded shards), as a scalar tensor
    (float32; float64 for float64 gradients): what ``torch.nn.utils.get_total_norm`` gives, in a fraction of its
    time on a many-core host.

    torch's norm of a CPU tensor runs on about one core, so an 8B model's fp32 gradients take seconds; here every
    shard is cut into pieces of ``chunk`` elements whose norms run side by side on `host_thread_share` threads
    (each op on one core), summed in float64. Gradients on a GPU (units kept resident) are normed there. DTensor
    shards are summed over the ranks that shard them (and not over the ranks that replicate them), so every rank
    gets the same norm.
    """
    from concurrent.futures import ThreadPoolExecutor

    groups: dict[Any, list[torch.Tensor]] = {}
    for p in parameters:
        g = p.grad
        if g is None:
            continue
        key = (g.device_mesh, tuple(g.placements)) if hasattr(g, "device_mesh") else None
        groups.setdefault(key, []).append(_local(g))
    pieces = [(key, part) for key, gs in groups.items() for g in gs if g.device.type == "cpu"
              for part in g.reshape(-1).split(chunk)]  # fmt: skip
    totals: dict[Any, float] = {key: 0.0 for key in groups}
    for key, gs in groups.items():  # resident gradients: their norms on their device, one transfer
        there = [g for g in gs if g.device.type != "cpu"]
        if there:
            norms = torch._foreach_norm(there, 2.0)
            totals[key] += float(torch.stack(norms).to(torch.float64).square().sum())

    def sumsq(part: torch.Tensor) -> float:
        return float(torch.linalg.vector_norm(part, dtype=torch.promote_types(part.dtype, torch.float32))) ** 2

    share = host_thread_share()
    with host_threads(1), ThreadPoolExecutor(share, initializer=torch.set_num_threads, initargs=(1,)) as pool:
        sums = list(pool.map(sumsq, [part for _, part in pieces]))
    for (key, _), v in zip(pieces, sums, strict=True):
        totals[key] += v
    total = 0.0
    for key, v in totals.items():
        if key is not None:  # the partial sums of the shards, summed over the mesh dimensions that shard them
            from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

            mesh, placements = key
            parts = [Partial() if isinstance(pl, Shard) else Replicate() for pl in placements]
            v = float(DTensor.from_local(torch.tensor(v, dtype=torch.float64), mesh, parts).full_tensor())
        total += v
    wide = any(g.dtype == torch.float64 for gs in groups.values() for g in gs)
    return torch.tensor(total**0.5, dtype=torch.float64 if wide else torch.float32)


def clip_scale(norm: float, max_norm: float | None) -> float | None:
    """What clipping to ``max_norm`` multiplies gradients of total norm ``norm`` by (``clip_grad_norm_``'s
    coefficient), or None where it leaves them as they are (no ``max_norm``, or a norm within it)."""
    if max_norm is None:
        return None
    coef = max_norm / (norm + 1e-6)
    return coef if coef < 1.0 else None


class OverlappedHostStep:
    """The host's AdamW step of an offloaded model taken unit by unit in a background thread while the next forward
    runs, instead of all of it between the backward and that forward.

    Each unit's parameters are stepped (and their gradients cleared) in the order the forward gathers them (the root
    first, then `decoder_units`); a forward pre-hook on every unit, ahead of FSDP2's own, waits until that unit and
    the ones it prefetches are stepped, so no gather reads a shard the step is still writing. The result is the step
    of ``optimizer.step()`` then ``zero_grad()``, to the bit: the same fused kernel over the same parameters with the
    same gradients and hyperparameters, and AdamW's states are the optimizer's own (its ``state_dict`` is
    unchanged). What it hides is the CPU step's time behind the GPU's compute of the units before. Units kept
    resident on the GPU (`apply_fsdp`'s ``resident_units``, the first ones the forward gathers) are stepped at once
    in ``step()``: their kernels queue ahead of the next forward's, which starts on them without waiting.

    The background thread steps the shards' local tensors (views of the same storage), not the DTensors: a DTensor
    op's dispatch is Python, which would hold the interpreter lock against the main thread's kernel launches for the
    whole step. Only the first step, which creates the states, goes through the DTensors, and runs at once in
    ``step()`` (it reads each gradient as it goes, which a ``zero_grad()`` after ``step()`` would clear).

        opt = host_adamw(model, lr=3e-4)
        overlap = OverlappedHostStep(opt, model)
        loss.backward()
        norm = host_grad_norm(model.parameters())
        overlap.step(grad_scale=clip_scale(float(norm), max_norm))  # returns at once
        overlap.wait()          # before reading the weights or states other than through a forward or a
                                # state_dict (both wait by themselves: hooks)

    Args:
        optimizer: `host_adamw`'s optimizer of ``model``.
        model: the offloaded model (`offload_model`).
        units: its units in the order they run (default `decoder_units`); what no unit holds is the root's.
        prefetch: how many units ahead each unit's forward gathers (`apply_fsdp` sets 1).
        background: False takes the same per-unit step at once, in ``step()`` (the reference the overlapped
            step equals).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, model: nn.Module, units: list[nn.Module] | None = None,
                 prefetch: int = 1, background: bool = True) -> None:  # fmt: skip
        from longctx.distributed.mesh import decoder_units

        units = decoder_units(model) if units is None else list(units)
        owners = unit_parameters(model, units)
        # the units whose states stay on the GPU (`apply_fsdp`'s resident_units): stepped at once, in step(), by
        # kernels queued ahead of the next forward's
        self._resident = getattr(model, "_longctx_resident_units", 0)
        where = {id(p): j for j, g in enumerate(optimizer.param_groups) for p in g["params"]}
        self.optimizer = optimizer
        self.background = background
        # per unit: its stepped parameters, by the optimizer's group they belong to
        self._groups: list[list[tuple[int, list[torch.Tensor]]]] = []
        for ps in owners:
            by_group: dict[int, list[torch.Tensor]] = {}
            for p in ps:
                if id(p) in where:
                    by_group.setdefault(where[id(p)], []).append(p)
            self._groups.append(sorted(by_group.items()))
        n = len(self._groups)
        self._done = [threading.Event() for _ in range(n)]
        for e in self._done:
            e.set()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._waited, self._ran_s, self._ran_at_once = 0.0, None, False
        # at each step(), of the step before: its own time, and how much of it was not hidden (what the forward
        # after it waited for it; all of it for a step taken at once)
        self.last_host_step_s: float | None = None
        self.last_waited_s: float | None = None
        for i, module in enumerate([model, *units]):
            # the root gathers its own parameters; a unit, its own and the next ``prefetch`` units'
            last = 0 if i == 0 else min(n - 1, i + prefetch)
            module.register_forward_pre_hook(lambda *_, last=last: self._wait_until(last), prepend=True)
        # and every unit before the forward ends: a unit the forward skipped is stepped before the backward
        model.register_forward_hook(lambda *_: self._wait_until(n - 1))
        # a checkpoint (or a load) of the model or the optimizer waits for the step: no weight or state mid-update
        model.register_state_dict_pre_hook(lambda *_: self.wait())
        model.register_load_state_dict_pre_hook(lambda *_: self.wait())
        optimizer.register_state_dict_pre_hook(lambda *_: self.wait())
        optimizer.register_load_state_dict_pre_hook(lambda *_: self.wait())

    def step(self, grad_scale: float | None = None) -> None:
        """Start the step of every unit (after the backward); returns at once (``background=False``: after it).
        ``grad_scale`` multiplies the gradients first (a clipping coefficient), in the background too."""
        self.wait()
        self.last_host_step_s = self._ran_s
        self.last_waited_s = self._ran_s if self._ran_at_once else None if self._ran_s is None else self._waited
        self._waited = 0.0
        work = [self._unit_step(groups) for groups in self._groups]  # on this thread: it reads Python objects
        for e in self._done:
            e.clear()
        # a first step creates the states through the DTensors, reading each .grad when it runs: at once, before a
        # zero_grad() after step() can clear them
        self._ran_at_once = not self.background or any(u is not None and u[3] for u in work)
        items = list(enumerate(work))
        if self._ran_at_once:
            self._run(items, grad_scale)
            self._raise()
            return
        k = self._resident
        if k:  # the resident units' step: GPU kernels, queued now, ahead of the next forward
            self._run(items[:k], grad_scale)
            if self._error is not None:  # no step of the others follows: nothing is left to wait for
                for e in self._done:
                    e.set()
                self._raise()
        # not a daemon: a process ending while a step runs waits for it (a daemon thread would be torn down inside
        # torch's operations as the interpreter shuts down)
        self._thread = threading.Thread(target=self._run, args=(items[k:], grad_scale), name="longctx-host-step",
                                        daemon=False)  # fmt: skip
        self._thread.start()

    def _unit_step(self, groups: list[tuple[int, list[torch.Tensor]]]) -> tuple[Any, list, list, bool] | None:
        """One unit's step: an optimizer over its shards' local tensors sharing the optimizer's states (or over
        the parameters themselves where a state does not exist yet: ``first``), the local gradients, what to clear
        after, and ``first``."""
        opt = self.optimizer
        local_groups, state, grads, held = [], {}, [], []
        first = False
        for j, ps in groups:
            hyper = {k: v for k, v in opt.param_groups[j].items() if k != "params"}  # this step's (the lr's)
            with_grad = [p for p in ps if p.grad is not None]
            first |= any(not opt.state.get(p) for p in with_grad)
            local_groups.append((hyper, with_grad))
        if not any(ps for _, ps in local_groups):
            return None
        stepper = copy.copy(opt)  # its class, settings and step hooks
        if isinstance(stepper, HostAdamW):  # the plain AdamW step, not HostAdamW's (which starts this one)
            stepper.__class__ = torch.optim.AdamW
        if first:  # the optimizer's own step over the DTensors creates the states
            stepper.param_groups = [{**hyper, "params": ps} for hyper, ps in local_groups if ps]
            grads = [_local(p.grad) for _, ps in local_groups for p in ps]
            return stepper, grads, [p for _, ps in local_groups for p in ps], True
        stepper.param_groups = []
        for hyper, ps in local_groups:
            if not ps:
                continue
            lps = []
            for p in ps:
                lp, lg = _local(p), _local(p.grad)
                lp.grad = lg
                state[lp] = {k: _local(v) for k, v in opt.state[p].items()}
                lps.append(lp)
                grads.append(lg)
                held += [lp, p]
            stepper.param_groups.append({**hyper, "params": lps})
        stepper.state = collections.defaultdict(dict, state)
        return stepper, grads, held, False

    def _run(self, items: list[tuple[int, Any]], grad_scale: float | None) -> None:
        t0 = time.perf_counter()
        try:
            with host_threads():
                for i, unit in items:
                    if unit is not None:
                        stepper, grads, held, _ = unit
                        if grad_scale is not None and grads:
                            torch._foreach_mul_(grads, grad_scale)
                        stepper.step()
                        for t in held:
                            t.grad = None
                    self._done[i].set()
        except BaseException as exc:  # raised on the main thread, at its next wait
            self._error = exc
        finally:
            self._ran_s = time.perf_counter() - t0
            for i, _ in items:
                self._done[i].set()

    def _wait_until(self, last: int) -> None:
        if not self._done[last].is_set():
            t0 = time.perf_counter()
            for e in self._done[: last + 1]:
                e.wait()
            self._waited += time.perf_counter() - t0
        self._raise()

    def wait(self) -> None:
        """Wait for the step started last to end (a no-op when none runs); raises what it raised."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            exc, self._error = self._error, None
            raise RuntimeError(f"the overlapped host optimizer step failed: {exc}") from exc


class HostAdamW(torch.optim.AdamW):
    """`host_adamw`'s optimizer with ``max_grad_norm`` or ``overlap``: an ``AdamW`` (fused, on the host's fp32
    shards; its ``state_dict``, parameter groups and schedulers as AdamW's) whose ``step()`` takes the gradient norm
    on the host's cores (`host_grad_norm`, kept in ``last_grad_norm``), clips to ``max_grad_norm``, and steps, at
    once or, with ``overlap``, behind the next forward (`OverlappedHostStep`: a forward, a ``state_dict`` or a
    ``load_state_dict`` waits for it; `wait` before reading the weights otherwise). A step whose gradient norm is
    NaN or infinite is skipped (its gradients dropped, the weights untouched) and counted in ``skipped_steps``.
    """

    def __init__(self, params: Any, model: nn.Module, *, lr: float, betas: tuple[float, float],
                 max_grad_norm: float | None, overlap: bool) -> None:  # fmt: skip
        super().__init__(params, lr=lr, betas=betas, fused=True)
        self.max_grad_norm = max_grad_norm
        self.last_grad_norm: float | None = None
        self.skipped_steps = 0
        self.host_step = OverlappedHostStep(self, model, background=overlap)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("HostAdamW.step takes no closure: call the forward and backward before step()")
        params = [p for g in self.param_groups for p in g["params"]]
        norm = float(host_grad_norm(params))
        self.last_grad_norm = norm
        if not math.isfinite(norm):
            self.host_step.wait()
            for p in params:
                p.grad = None
            self.skipped_steps += 1
            return None
        self.host_step.step(grad_scale=clip_scale(norm, self.max_grad_norm))
        return None

    def wait(self) -> None:
        """Wait for an overlapped step still running (a no-op otherwise)."""
        self.host_step.wait()


def host_thread_share() -> int:
    """This process's share of the host's cores: the cores it may run on, divided by the processes torchrun
    started on this host (``LOCAL_WORLD_SIZE``; 1 without torchrun), at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    return max(1, cores // local)


@contextlib.contextmanager
def host_threads(threads: int | None = None) -> Iterator[int]:
    """Run the block with ``threads`` intra-op threads (default: `host_thread_share`), the count before restored
    after it. For the host's share of an offloaded step: every rank does it at the same moment, while its GPU
    waits, so the shares do not oversubscribe the host."""
    n = host_thread_share() if threads is None else threads
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield n
    finally:
        torch.set_num_threads(before)


def step_on_host_threads(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Make every ``optimizer.step()`` run on `host_thread_share` threads (step hooks; the count before is
    restored after each step); returns the optimizer."""
    saved: list[int] = []

    def pre(*_: object) -> None:
        saved.append(torch.get_num_threads())
        torch.set_num_threads(host_thread_share())

    def post(*_: object) -> None:
        torch.set_num_threads(saved.pop())

    optimizer.register_step_pre_hook(pre)
    optimizer.register_step_post_hook(post)
    return optimizer


def build_device(parameter_bytes: int, device: torch.device) -> torch.device:
    """Where to build (and initialise) a model that will be offloaded: on the GPU when its fp32 weights take under
    half of the GPU's free memory (initialising 8B weights there takes a second, on the CPU a minute), else on the
    host. FSDP2 moves each unit into its pinned host shard either way."""
    if device.type == "cuda" and parameter_bytes < torch.cuda.mem_get_info(device)[0] // 2:
        return device
    return torch.device("cpu")


def host_rss() -> int:
    """This process's resident host memory in bytes (pinned buffers included), 0 where unknown."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class HostPeak:
    """The peak resident host memory of this process while the block runs, sampled every ``interval`` seconds.

    with HostPeak() as host:
        step()
    host.peak  # bytes
    """

    def __init__(self, interval: float = 0.02) -> None:
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, host_rss())

    def __enter__(self) -> HostPeak:
        self.peak = host_rss()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak = max(self.peak, host_rss())
