"""The test lanes, defined once: markers by folder, and the skips a lane needs.

    tests/unit/         CPU: references, masks, dispatch, model, recomputation, training (always run)
    tests/interpreter/  Triton kernels under TRITON_INTERPRET=1 on the CPU (marker `interpreter`)
    tests/distributed/  several gloo processes on the CPU (marker `distributed`)
    tests/gpu/          a CUDA GPU (marker `gpu`; skipped without one); `hopper` tests need sm_90

Select a lane with ``-m``, e.g. ``pytest -m "not interpreter and not distributed"`` or ``pytest tests/gpu``.

The GPU lane has tiers (`dev/gpu_suite.sh` sets them):

    --gpu-tier quick    every GPU test function with the fewest of its cases that still take every value of every
                        parameter once (every kernel path, head dim, band and dtype the function covers)
    --gpu-tier full     every case (the default)
    --gpu-part K/N      the K-th of N interleaved parts of the selected GPU cases (1 <= K <= N), so that the full
                        matrix runs in calls that each fit a time limit

Tests of other lanes are never deselected by these options.
"""

from __future__ import annotations

import atexit
import functools
import os
import pathlib
import sys

import pytest

_LANES = {"interpreter": "interpreter", "distributed": "distributed", "gpu": "gpu"}

# Triton 3.9 warns that its FP-fusion default will change; the kernels are tested as every Triton so far compiles
# them (fusion on), which this keeps, without the warning (older Tritons do not read it).
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")


@functools.cache
def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@functools.cache
def _hopper() -> bool:
    import torch

    return _cuda() and torch.cuda.get_device_capability()[0] == 9


def pytest_addoption(parser):
    group = parser.getgroup("longctx GPU lane")
    group.addoption("--gpu-tier", choices=("quick", "full"), default="full", help="GPU tests: quick or full tier")
    group.addoption("--gpu-part", default=None, metavar="K/N", help="GPU tests: run the K-th of N parts")


def _gpu_part(text: str) -> tuple[int, int]:
    k, sep, n = text.partition("/")
    try:
        k_i, n_i = int(k), int(n)
    except ValueError:
        k_i = n_i = 0
    if not sep or not 1 <= k_i <= n_i:
        raise pytest.UsageError(f"--gpu-part expects K/N with 1 <= K <= N, e.g. 2/3; got {text!r}")
    return k_i, n_i


def quick_cases(items: list) -> list:
    """The quick tier: per test function, in collection order, the cases that bring a (parameter, value) pair not
    yet seen, so every value of every parameter runs at least once; unparametrised tests all stay."""
    seen: set = set()
    kept = []
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is None:
            kept.append(item)
            continue
        func = (item.nodeid.split("[")[0],)
        pairs = {func + (name, repr(value)) for name, value in callspec.params.items()}
        if not pairs <= seen:
            seen |= pairs
            kept.append(item)
    return kept


def _select_gpu(config, items: list) -> None:
    tier, part = config.getoption("--gpu-tier"), config.getoption("--gpu-part")
    if tier == "full" and part is None:
        return
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    chosen = quick_cases(gpu) if tier == "quick" else gpu
    if part is not None:
        k, n = _gpu_part(part)
        chosen = chosen[k - 1 :: n]
    keep = {id(item) for item in chosen}
    dropped = [item for item in gpu if id(item) not in keep]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        gone = {id(item) for item in dropped}
        items[:] = [item for item in items if id(item) not in gone]


def pytest_collection_modifyitems(config, items):
    here = pathlib.Path(__file__).parent
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    no_hopper = pytest.mark.skip(reason="needs an sm_90 (Hopper) GPU")
    for item in items:
        lane = pathlib.Path(str(item.fspath)).relative_to(here).parts[0]
        if lane in _LANES:
            item.add_marker(_LANES[lane])
        if item.get_closest_marker("gpu") and not _cuda():
            item.add_marker(no_gpu)
        elif item.get_closest_marker("hopper") and not _hopper():
            item.add_marker(no_hopper)
    _select_gpu(config, items)


@pytest.fixture(autouse=True)
def _close_process_group():
    """A process group a test opened in this process (the one-rank mesh of offload_params, init_mesh(1, 1)) is
    closed after it: every test starts without one."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def ws_switches():
    """The dense launchers (`longctx.launchers.flash`), with every `longctx.tuning` override the test sets (``ws``,
    ``ws_config``, ``ws_bwd``, ``ws_bwd_config``, ...) undone afterwards."""
    from longctx import tuning
    from longctx.launchers import flash as tf

    with tuning.override():
        yield tf


@pytest.fixture
def count_calls(monkeypatch):
    """``count_calls(module, name)`` wraps ``module.name`` (a kernel launcher) for the test and returns the list
    that gets one entry per call: tests assert that an input took the kernel they mean to test."""

    def wrap(module, name: str) -> list:
        calls: list = []
        real = getattr(module, name)

        def counted(*args, **kwargs):
            calls.append(1)
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
        return calls

    return wrap


def _drop_stderr_at_exit() -> None:
    """At interpreter exit, after every test has reported: nanobind (Triton's compiler bindings) prints a report of
    the objects still alive at finalization, ~150 lines of "nanobind: leaked ..." below pytest's summary, once a
    process has compiled a kernel. Nothing else reaches stderr that late."""
    sys.stderr.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)


def pytest_unconfigure(config):
    if "triton._C.libtriton" in sys.modules:  # this process loaded Triton's compiler: quiet its exit
        atexit.register(_drop_stderr_at_exit)


@pytest.fixture
def recorded_pointwise_launches(monkeypatch):
    """The position-wise kernels' launches a compile-ahead records, on the CPU: the launchers' path taken as on a
    GPU (`launchers.pointwise.supports` says yes), and `launchers.runtime.compile_launches` keeping the recorded
    launches in the list this yields instead of compiling them (it reports each one compiled, in 0 s)."""
    from longctx.launchers import pointwise, runtime

    recorded: list = []

    def compile_launches(launches, device, workers=None):
        recorded.extend(launches)
        return [(k.__name__, 0.0, "") for k, *_ in launches]

    monkeypatch.setattr(pointwise, "supports", lambda *tensors: True)
    monkeypatch.setattr(runtime, "compile_launches", compile_launches)
    return recorded
