"""dev/tune_tiles.py --write: a measurement of some head dims replaces that GPU's rows at those head dims, keeps its
rows at the others and every other GPU's rows, and leaves a `tuning.py` whose table reads back as written."""

from __future__ import annotations

import ast
import importlib.util
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _load(path: pathlib.Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _table(tuning_py: pathlib.Path, tool) -> dict:
    src = tuning_py.read_text()
    block = src[src.index(tool.BEGIN) + len(tool.BEGIN) : src.index(tool.END)]
    return ast.literal_eval("{" + block + "}")


def test_write_replaces_only_the_measured_head_dims(tmp_path):
    tool = _load(ROOT / "dev" / "tune_tiles.py", "tune_tiles_under_test")
    tuning_py = tmp_path / "tuning.py"
    tuning_py.write_text((ROOT / "src" / "longctx" / "tuning.py").read_text())
    before = _table(tuning_py, tool)
    gpu = "NVIDIA H100 80GB HBM3"
    assert any(k.split(":")[1] == "256" for k in before[gpu]) and any(k.split(":")[1] == "64" for k in before[gpu])
    new_rows = {"dv:256:full:4:mha": 3, "fwd:256:causal:1:mha": 1}
    measured = tmp_path / "tiles.json"
    measured.write_text(json.dumps({"gpu": gpu, "head_dims": [256], "rows": new_rows, "times_ms": {}}))

    tool.write(measured, tuning_py)

    after = _table(tuning_py, tool)
    other = {k: v for k, v in before[gpu].items() if k.split(":")[1] != "256"}
    assert after[gpu] == {**other, **new_rows}
    assert {g: t for g, t in after.items() if g != gpu} == {g: t for g, t in before.items() if g != gpu}
    module = _load(tuning_py, "tuning_written")  # still a valid module, its table the one written
    assert after == module.MEASURED_TILES


def test_write_records_the_gpu_facts_for_the_nearest_row(tmp_path):
    """A new GPU's measurement adds its row and its facts (capability, SMs, memory), which `tuning.tile_row` then
    matches other GPUs of that capability against."""
    tool = _load(ROOT / "dev" / "tune_tiles.py", "tune_tiles_under_test_facts")
    tuning_py = tmp_path / "tuning.py"
    tuning_py.write_text((ROOT / "src" / "longctx" / "tuning.py").read_text())
    measured = tmp_path / "tiles.json"
    data = {"gpu": "NVIDIA H20", "facts": [[9, 0], 78, 96], "head_dims": [128], "rows": {"fwd:128:full:4:mha": 1}}
    measured.write_text(json.dumps({**data, "times_ms": {}}))
    tool.write(measured, tuning_py)
    tool.write(measured, tuning_py)  # again: replaced, not repeated
    module = _load(tuning_py, "tuning_written_facts")
    before = _load(ROOT / "src" / "longctx" / "tuning.py", "tuning_before_facts")
    assert module.MEASURED_GPUS["NVIDIA H20"] == ((9, 0), 78, 96)
    assert len(module.MEASURED_GPUS) == len(before.MEASURED_GPUS) + 1
    assert module.MEASURED_TILES["NVIDIA H20"] == {"fwd:128:full:4:mha": 1}
    assert module.tile_row("NVIDIA H20 (another board)", (9, 0), 78, 96)[0] == "NVIDIA H20"
    assert module.tile_row("NVIDIA H200 NVL", (9, 0), 132, 141)[0] == "NVIDIA H200"
    assert module.tile_row("NVIDIA H100 PCIe", (9, 0), 114, 80)[0] == "NVIDIA H100 80GB HBM3"
