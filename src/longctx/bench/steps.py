"""One training-step timer for the model benchmarks (`longctx bench memory`, `longctx bench transformers`).

`time_steps` builds a step, runs the warm-up steps, times ``steps`` more one by one (synchronising CUDA around
each) and reports the median step, tokens/s and the peak memory: ``torch.cuda.max_memory_allocated`` since the
warm-up ended on CUDA; on the CPU the peak of live tensors of one more step (`longctx.memory.measure`). An error
is a result, never a raise: ``oom`` for an allocator failure, ``error`` for anything else, with the message.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from longctx.distributed.offload import HostPeak

__all__ = ["OK", "OOM", "ERROR", "StepResult", "adamw", "free", "is_oom", "time_steps", "training_step"]

OK, OOM, ERROR = "ok", "oom", "error"


@dataclass
class StepResult:
    """What ``steps`` timed training steps gave: a code (``ok`` / ``oom`` / ``error``) and, when ok, the figures."""

    tokens: int  # tokens per step
    code: str
    step_s: float | None = None  # median seconds per step
    tokens_per_s: float | None = None
    peak_bytes: int | None = None
    error: str = ""  # "<exception type>: <message>" unless ok
    secs: float = 0.0  # wall seconds of the whole measurement, building the step included
    host_peak_bytes: int | None = None  # peak resident host memory during the timed steps
    phases: dict[str, float] | None = None  # median seconds of the step's phases, where the step reports them
    probe: dict | None = None  # what time_steps' probe measured after the timed steps
    reserved_bytes: int | None = None  # peak torch.cuda.max_memory_reserved (the allocator's cache), on CUDA

    @property
    def ok(self) -> bool:
        return self.code == OK

    @property
    def oom(self) -> bool:
        return self.code == OOM


def is_oom(exc: BaseException) -> bool:
    """An allocator failure: ``torch.OutOfMemoryError`` or a RuntimeError saying "out of memory"."""
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device: torch.device) -> None:
    """Collect garbage and return the CUDA allocator's cached blocks."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def adamw(model: torch.nn.Module, device: torch.device) -> torch.optim.Optimizer:
    """The benchmarks' optimizer: AdamW, lr 1e-5, fused on CUDA, over the parameters that train (a LoRA run's
    adapters)."""
    trained = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(trained, lr=1e-5, fused=device.type == "cuda")


class _Step:
    """A step: ``loss_fn()`` under bf16 autocast, backward, the optimizer step, gradients set to None; ``phases``
    holds the seconds of the last step's forward + backward and of its optimizer step (the device synchronised
    between them). With ``host_step`` (the `distributed.offload.OverlappedHostStep` of ``opt``, a `HostAdamW`)
    the optimizer step may run behind the next step's forward: its phase is then the norm and the step's start,
    ``host_step_s`` and ``forward_waited_s`` the step before's own time and what this forward waited for it;
    `finish` waits for the last one."""

    def __init__(self, loss_fn: Callable[[], torch.Tensor], opt: torch.optim.Optimizer, device: torch.device,
                 host_step=None):  # fmt: skip
        self.loss_fn, self.opt, self.device, self.host_step = loss_fn, opt, device, host_step
        self.phases: dict[str, float] = {}

    def finish(self) -> None:
        if self.host_step is not None:
            self.host_step.wait()

    def __call__(self) -> None:
        t = time.perf_counter()
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            loss = self.loss_fn()
        loss.backward()
        _sync(self.device)
        t_opt = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        _sync(self.device)
        self.phases = {"forward_backward_s": t_opt - t, "optimizer_s": time.perf_counter() - t_opt}
        if self.host_step is not None and self.host_step.background and self.host_step.last_waited_s is not None:
            self.phases["host_step_s"] = self.host_step.last_host_step_s  # the step before this one's, now done
            self.phases["forward_waited_s"] = self.host_step.last_waited_s


def training_step(
    loss_fn: Callable[[], torch.Tensor], opt: torch.optim.Optimizer, device: torch.device, host_step=None
) -> Callable[[], None]:
    """A step: ``loss_fn()`` under bf16 autocast, backward, the optimizer step, gradients set to None (its
    ``phases``: the seconds of the forward + backward and of the optimizer step); ``host_step``: see `_Step`."""
    return _Step(loss_fn, opt, device, host_step)


def _finish(step) -> None:
    finish = getattr(step, "finish", None)
    if finish is not None:
        finish()


def time_steps(
    make_step: Callable[[], Callable[[], None]],
    *,
    tokens: int,
    steps: int,
    warmup: int,
    device: torch.device,
    probe: Callable[[Callable[[], None]], dict] | None = None,
) -> StepResult:
    """Build the step with ``make_step()`` and measure it (see the module doc); ``tokens`` per step give tokens/s.
    ``probe(step)``, if given, runs after the timed steps and its dict goes to ``StepResult.probe``.

    What ``make_step`` builds is released (and the CUDA cache emptied) before returning, unless the caller
    keeps a reference to it.
    """
    t0 = time.perf_counter()
    step = None
    try:
        step = make_step()
        for _ in range(warmup):
            step()  # a step whose optimizer runs behind the next one: the last warm-up's runs behind the first timed
        _sync(device)
        free(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times = []
        phases: dict[str, list[float]] = {}
        with HostPeak() as host:
            for _ in range(steps):
                _sync(device)
                t = time.perf_counter()
                step()
                _sync(device)
                times.append(time.perf_counter() - t)
                for k, v in getattr(step, "phases", {}).items():
                    phases.setdefault(k, []).append(v)
            _finish(step)  # a step whose optimizer runs behind the next one: the last one ends before the peaks
        reserved = None
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device)
            reserved = torch.cuda.max_memory_reserved(device)
        else:
            from longctx.memory.measure import peak_live_bytes

            peak = peak_live_bytes(step)
        med = statistics.median(times)
        probed = probe(step) if probe is not None else None
        return StepResult(tokens, OK, med, tokens / med, peak, secs=time.perf_counter() - t0, host_peak_bytes=host.peak,
                          phases={k: statistics.median(v) for k, v in phases.items()} or None,
                          probe=probed, reserved_bytes=reserved)  # fmt: skip
    except Exception as e:  # noqa: BLE001 - an out-of-memory error is a result; anything else is reported
        code = OOM if is_oom(e) else ERROR
        return StepResult(tokens, code, error=f"{type(e).__name__}: {str(e)[:300]}", secs=time.perf_counter() - t0)
    finally:
        if step is not None:  # the probe's step too: its optimizer ends before the model goes
            with contextlib.suppress(Exception):  # the result above is what is reported
                _finish(step)
        del step
        free(device)
