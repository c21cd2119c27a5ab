"""The per-GPU tile table: which entry a launch takes (its own row, the nearest measured length bucket of the same
kernel, band and grouping, else the list's first entry), and the H100 rows all name existing entries."""

from __future__ import annotations

from unittest import mock

import pytest

from longctx import tuning


@pytest.fixture
def table(monkeypatch):
    rows = {
        "fwd:128:causal:1:mha": 2,
        "fwd:128:causal:4:mha": 1,
        "fwd:128:full:4:mha": 3,
        "sparse_fwd:64:128:2": 1,
        "dq:64:full:0:mha": 9,  # past the end of its list: ignored
    }
    monkeypatch.setitem(tuning.MEASURED_TILES, "Test GPU", rows)
    tuning.measured_index.cache_clear()
    yield
    tuning.measured_index.cache_clear()


@pytest.mark.parametrize(
    "key, expected",
    [
        ("fwd:128:causal:1:mha", 2),  # its own row
        ("fwd:128:causal:0:mha", 2),  # nearest bucket 1
        ("fwd:128:causal:5:mha", 1),  # nearest bucket 4
        ("fwd:128:causal:1:gqa", 0),  # no gqa row: the first entry
        ("fwd:128:window:1:mha", 0),  # no window row
        ("sparse_fwd:64:128:5", 1),  # the sparse key's bucket is field 3 too
        ("sparse_fwd:64:64:2", 0),  # another mask block size
        ("dq:64:full:0:mha", 0),  # an index past the list
    ],
)
def test_measured_index(table, key, expected):
    assert tuning.measured_index("Test GPU", key, 4) == expected


def test_a_gpu_without_rows_takes_the_first_entries(table):
    assert tuning.measured_index("Other GPU", "fwd:128:causal:1:mha", 4) == 0


def test_keys_and_band_kinds():
    assert tuning.tile_key("dq", 128, tuning.band_kind(False, True), 3, True) == "dq:128:causal:3:gqa"
    assert tuning.band_kind(False, False) == "full" and tuning.band_kind(True, True) == "window"
    assert tuning.sparse_tile_key("fwd", 64, 128, 2) == "sparse_fwd:64:128:2"


def test_every_committed_row_names_an_entry_of_its_list():
    for gpu, rows in tuning.MEASURED_TILES.items():
        for key, index in rows.items():
            kind, bd, third, *_ = key.split(":")
            if kind.startswith("sparse_"):
                n = len(tuning.sparse_tile_choices(kind[len("sparse_") :], int(bd), int(third)))
            else:
                n = len(tuning.table(kind)[int(bd)])
            assert 0 <= index < n, (gpu, key, index, n)


def test_a_gpu_without_a_row_takes_the_nearest_measured_one_of_its_capability():
    """An H200 NVL (or H100 PCIe / NVL, H800, H20, GH200) runs the measured tiles of the nearest measured Hopper
    (SM count, then memory), never silently each list's first entry; a GPU of another capability has no measured
    row, and says so."""
    from longctx import tuning

    row, why = tuning.tile_row("NVIDIA H100 80GB HBM3", (9, 0), 132, 80)
    assert row == "NVIDIA H100 80GB HBM3" and "measured on this GPU" in why
    assert tuning.tile_row("NVIDIA H200", (9, 0), 132, 141)[0] == "NVIDIA H200"
    row, why = tuning.tile_row("NVIDIA H200 NVL", (9, 0), 132, 141)
    assert row == "NVIDIA H200" and "nearest measured GPU of compute capability 9.0" in why
    assert tuning.tile_row("NVIDIA H100 NVL", (9, 0), 132, 94)[0] == "NVIDIA H100 80GB HBM3"  # nearer in memory
    assert tuning.tile_row("NVIDIA H100 PCIe", (9, 0), 114, 80)[0] == "NVIDIA H100 80GB HBM3"
    row, why = tuning.tile_row("NVIDIA A100-SXM4-80GB", (8, 0), 108, 80)
    assert row is None and "none measured for compute capability 8.0" in why
    with mock.patch.dict(tuning.MEASURED_GPUS, {"NVIDIA H20": ((9, 0), 78, 96)}), \
            mock.patch.dict(tuning.MEASURED_TILES, {"NVIDIA H20": {}}):  # fmt: skip
        assert tuning.tile_row("NVIDIA H100 PCIe", (9, 0), 114, 80)[0] == "NVIDIA H100 80GB HBM3"  # nearer in SMs
        assert tuning.tile_row("NVIDIA H800 PCIe", (9, 0), 80, 80)[0] == "NVIDIA H20"


def test_the_launchers_key_their_tiles_by_the_serving_row(monkeypatch):
    """What the launchers look up on a mocked H100 NVL: the H100 SXM row's entries."""
    import torch

    from longctx.launchers import runtime

    class Props:
        name, multi_processor_count, total_memory = "NVIDIA H100 NVL", 132, 94 * 2**30

    runtime.gpu_name.cache_clear()
    runtime.tile_row_line.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (9, 0))
    monkeypatch.setattr(runtime, "_interpret", lambda: False)
    try:
        assert runtime.gpu_name(0) == "NVIDIA H100 80GB HBM3"
        assert "nearest measured GPU" in runtime.tile_row_line(0)[1]
    finally:
        runtime.gpu_name.cache_clear()
        runtime.tile_row_line.cache_clear()
