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

`longctx train --offload-params` and `integrations.transformers.apply(model, offload_params=True)` call these; the
planner (`longctx.memory.plan`, ``host_budget``) predicts both memories. `HostPeak` measures the host side.

The host's work of a step (the AdamW step, the gradient norm over host shards) runs on this process's share of the
host's cores (`host_threads`): torchrun starts every rank with one intra-op thread (``OMP_NUM_THREADS=1``), which
would leave an 8B model's CPU step on one core a rank.
"""

from __future__ import annotations

import contextlib
import copy
import os
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = [
    "offload_model",
    "host_adamw",
    "OverlappedHostStep",
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
    """
    from longctx.distributed.mesh import apply_fsdp, decoder_units, init_mesh

    if mesh is None:
        mesh = init_mesh(1, 1)
    if param_dtype == "auto":
        param_dtype = torch.bfloat16 if mesh.device_type == "cuda" else None
    apply_fsdp(model, mesh, offload_params=True, param_dtype=param_dtype,
               units=decoder_units(model) if units is None else units)  # fmt: skip
    return mesh


def host_adamw(
    model: nn.Module,
    lr: float,
    *,
    betas: tuple[float, float] = (0.9, 0.95),
    weight_decay: float = 0.1,
) -> torch.optim.AdamW:
    """AdamW on the host for an offloaded model: torch's fused CPU kernel over the fp32 master weights, weight decay
    on matrices only; only parameters that train (``requires_grad``, e.g. LoRA adapters) get states.

    Raises:
        ValueError: a parameter that is not in host memory (call `offload_model` first).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    on_gpu = [p for p in params if p.device.type != "cpu"]
    if on_gpu:
        raise ValueError(
            f"host_adamw steps parameters in host memory, but {len(on_gpu)} of them are on {on_gpu[0].device}: "
            "shard the model with offload_model (or apply_fsdp(..., offload_params=True)) first"
        )
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas, fused=True)
    return step_on_host_threads(optimizer)


class OverlappedHostStep:
    """The host's AdamW step of an offloaded model taken unit by unit in a background thread while the next forward
    runs, instead of all of it between the backward and that forward.

    Each unit's parameters are stepped (and their gradients cleared) in the order the forward gathers them (the root
    first, then `decoder_units`); a forward pre-hook on every unit, ahead of FSDP2's own, waits until that unit and
    the ones it prefetches are stepped, so no gather reads a shard the step is still writing. The result is the step
    of ``optimizer.step()`` then ``zero_grad()``, to the bit: the same fused kernel over the same parameters with the
    same gradients (clipped before, on the main thread) and hyperparameters, and AdamW's states are the optimizer's
    own (its ``state_dict`` is unchanged). What it hides is the CPU step's time behind the GPU's compute of the
    units before.

        opt = host_adamw(model, lr=3e-4)
        overlap = OverlappedHostStep(opt, model)
        loss.backward(); clip_grad_norm_(...)
        overlap.step()          # returns at once; the next forward waits only for the units it reaches
        overlap.wait()          # before reading the weights or the states (a checkpoint, an evaluation)

    Args:
        optimizer: `host_adamw`'s optimizer of ``model``.
        model: the offloaded model (`offload_model`).
        units: its units in the order they run (default `decoder_units`); what no unit holds is the root's.
        prefetch: how many units ahead each unit's forward gathers (`apply_fsdp` sets 1).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, model: nn.Module, units: list[nn.Module] | None = None,
                 prefetch: int = 1) -> None:  # fmt: skip
        from longctx.distributed.mesh import decoder_units

        units = decoder_units(model) if units is None else list(units)
        in_units = {id(p) for u in units for p in u.parameters()}
        stepped = {id(p) for g in optimizer.param_groups for p in g["params"]}
        owners = [[p for p in model.parameters() if id(p) not in in_units], *[list(u.parameters()) for u in units]]
        self.optimizer = optimizer
        self._params = [[p for p in ps if id(p) in stepped] for ps in owners]
        # per unit: the optimizer's groups narrowed to the unit's parameters, sharing the optimizer's states
        self._steppers = []
        for ps in self._params:
            mine = {id(p) for p in ps}
            groups = [(j, [p for p in g["params"] if id(p) in mine]) for j, g in enumerate(optimizer.param_groups)]
            groups = [(j, gps) for j, gps in groups if gps]
            if not groups:
                self._steppers.append(None)
                continue
            opt = copy.copy(optimizer)  # its class, settings and hooks, and its states (one set: the optimizer's)
            opt.param_groups = [{**optimizer.param_groups[j], "params": ps} for j, ps in groups]
            self._steppers.append((opt, [j for j, _ in groups]))
        self._done = [threading.Event() for _ in self._params]
        for e in self._done:
            e.set()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        n = len(self._params)
        for i, module in enumerate([model, *units]):
            # the root gathers its own parameters; a unit, its own and the next ``prefetch`` units'
            last = 0 if i == 0 else min(n - 1, i + prefetch)
            module.register_forward_pre_hook(lambda *_, last=last: self._wait_until(last), prepend=True)
        # and every unit before the forward ends: a unit the forward skipped is stepped before the backward
        model.register_forward_hook(lambda *_: self._wait_until(n - 1))

    def step(self) -> None:
        """Start the step of every unit (after the backward and the gradient clipping); returns at once."""
        self.wait()
        hypers = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        for stepper in self._steppers:  # the hyperparameters of this step (the learning rate of its schedule)
            if stepper is not None:
                for group, j in zip(stepper[0].param_groups, stepper[1]):
                    group.update(hypers[j])
        for e in self._done:
            e.clear()
        self._thread = threading.Thread(target=self._run, name="longctx-host-step", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            with host_threads():
                for i, stepper in enumerate(self._steppers):
                    if stepper is not None:
                        stepper[0].step()
                    for p in self._params[i]:
                        p.grad = None
                    self._done[i].set()
        except BaseException as exc:  # raised on the main thread, at its next wait
            self._error = exc
        finally:
            for e in self._done:
                e.set()

    def _wait_until(self, last: int) -> None:
        for e in self._done[: last + 1]:
            e.wait()
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
