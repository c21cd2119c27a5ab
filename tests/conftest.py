"""Fixtures shared by the GPU test modules."""

from __future__ import annotations

import pytest


@pytest.fixture
def ws_switches(monkeypatch):
    """`ops.triton_flash` with the warp-specialised kernels' switches and config tables free to change in the test:
    FORCE_WS / WS_CONFIG (forward) and FORCE_WS_BWD / WS_BWD_CONFIG (backward) are restored afterwards."""
    from longctx.launchers import flash as tf

    for name in ("FORCE_WS", "FORCE_WS_BWD"):
        monkeypatch.setattr(tf, name, getattr(tf, name))
    for name in ("WS_CONFIG", "WS_BWD_CONFIG"):
        monkeypatch.setattr(tf, name, dict(getattr(tf, name)))
    return tf


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
