"""The GPU lane's tiers (tests/conftest.py): the quick tier keeps every value of every parameter of each test
function at least once, the parts of the real GPU suite split its cases without losing or repeating one, and a bad
--gpu-part is a usage error naming the expected form."""

from __future__ import annotations

import itertools
import pathlib
import subprocess
import sys
from types import SimpleNamespace

import pytest

from tests.conftest import _gpu_part, quick_cases


def _items(func: str, **axes):
    names = list(axes)
    out = []
    for values in itertools.product(*axes.values()):
        params = dict(zip(names, values))
        ident = "-".join(map(str, values))
        out.append(
            SimpleNamespace(nodeid=f"tests/gpu/test_x.py::{func}[{ident}]", callspec=SimpleNamespace(params=params))
        )
    return out


def test_quick_tier_takes_every_value_once_per_function():
    a = _items("test_a", d=(64, 128, 256), causal=(False, True), dtype=("bf16", "fp16"))
    b = _items("test_b", d=(64, 128))
    plain = SimpleNamespace(nodeid="tests/gpu/test_x.py::test_plain")
    kept = quick_cases(a + [plain] + b)
    kept_a = [i for i in kept if "test_a" in i.nodeid]
    for axis, values in (("d", (64, 128, 256)), ("causal", (False, True)), ("dtype", ("bf16", "fp16"))):
        assert {i.callspec.params[axis] for i in kept_a} == set(values)
    assert len(kept_a) < len(a)  # 3 of the 12 cases cover every value (the first case brings three new ones)
    assert plain in kept
    # a value seen in test_a does not count for test_b: each function covers its own values
    assert [i.callspec.params["d"] for i in kept if "test_b" in i.nodeid] == [64, 128]
    # collection order is kept
    assert kept == sorted(kept, key=(a + [plain] + b).index)


def _collect(*args: str) -> list[str]:
    root = pathlib.Path(__file__).resolve().parents[2]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests/gpu", *args],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    return [line for line in run.stdout.splitlines() if "::" in line]


def test_gpu_suite_tiers_and_parts():
    full = _collect()
    quick = _collect("--gpu-tier", "quick")
    parts = [_collect("--gpu-part", f"{k}/3") for k in (1, 2, 3)]
    assert len(full) > len(quick) > 0 and set(quick) <= set(full)
    assert sorted(sum(parts, [])) == sorted(full)  # no case lost, none in two parts
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    # every GPU test module and test function is in the quick tier
    assert {n.split("[")[0] for n in quick} == {n.split("[")[0] for n in full}


@pytest.mark.parametrize("bad", ["3", "0/2", "3/2", "a/b", "1/0"])
def test_bad_part_is_a_usage_error(bad):
    with pytest.raises(pytest.UsageError, match="K/N"):
        _gpu_part(bad)
