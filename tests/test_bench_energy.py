"""The energy fit of `benchmarks/energy.py` (CPU): energy per call = a fixed part + a part per kept block."""

import importlib.util
import os

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "energy.py")


def _energy():
    spec = importlib.util.spec_from_file_location("bench_energy", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _row(case, blocks, fixed, per_uj, watts=700.0):
    mj = fixed + per_uj * blocks / 1000
    return {"case": case, "blocks": blocks, "mj_per_call": mj, "ms_per_call": mj / watts}


def test_fit_recovers_the_line_and_the_target():
    fit = _energy().fit
    rows = [
        _row("layout fwd", 26011, 44.0, 8.9),
        _row("causal fwd", 132096, 44.0, 8.9),
        _row("diag fwd", 2048, 47.0, 8.9),
        {"case": "layout bwd", "error": "x"},  # a failed case is left out
    ]
    out = fit(rows)
    assert set(out) == {"fwd"}
    f = out["fwd"]
    assert f["uj_per_block"] == pytest.approx(8.9)
    assert f["fixed_mj"] == pytest.approx(44.0)
    assert f["diag_fixed_mj"] == pytest.approx(47.0)
    assert f["block_ratio"] == pytest.approx(132096 / 26011)
    # equal power: the time ratio is the energy ratio, below the block ratio by the fixed part
    assert f["time_ratio"] == pytest.approx(f["energy_ratio"])
    assert f["energy_ratio"] < f["block_ratio"]
    # with the fixed part the target allows, causal / layout is exactly 5
    target = f["fixed_mj_for_target"]
    causal = 44.0 + 8.9 * 132096 / 1000
    assert causal / (target + 8.9 * 26011 / 1000) == pytest.approx(5.0)


def test_fit_needs_both_masks():
    assert _energy().fit([_row("layout fwd", 100, 1.0, 1.0)]) == {}
