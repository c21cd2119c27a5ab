"""The test lanes, defined once: markers by folder, and the skips a lane needs.

    tests/unit/         CPU: references, masks, dispatch, model, recomputation, training (always run)
    tests/interpreter/  Triton kernels under TRITON_INTERPRET=1 on the CPU (marker `interpreter`)
    tests/distributed/  several gloo processes on the CPU (marker `distributed`)
    tests/gpu/          a CUDA GPU (marker `gpu`; skipped without one); `hopper` tests need sm_90

Select a lane with ``-m``, e.g. ``pytest -m "not interpreter and not distributed"`` or ``pytest tests/gpu``.
"""

from __future__ import annotations

import functools
import pathlib

import pytest

_LANES = {"interpreter": "interpreter", "distributed": "distributed", "gpu": "gpu"}


@functools.cache
def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@functools.cache
def _hopper() -> bool:
    import torch

    return _cuda() and torch.cuda.get_device_capability()[0] == 9


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
