"""`longctx.warmup` and `longctx warmup`: argument checks, the lengths it runs, and the CLI without a GPU."""

from __future__ import annotations

import pytest
import torch

from longctx import warmup as wu
from longctx.cli.main import main as cli_main


def test_lengths_cover_each_bucket_once():
    from longctx import tuning

    lengths = wu._lengths(65536)
    buckets = [tuning.seq_bucket(n) for n in lengths]
    assert buckets == sorted(set(buckets)) == list(range(6))
    assert wu._lengths(3000) == [1024, 2048]
    assert wu._lengths(20000) == [1024, 2048, 4096, 8192, 16384, 20000]
    assert wu._lengths(512) == [512]


def test_plan_adds_an_uneven_token_count_for_packed_documents():
    assert wu._plan(["causal"], None, 2048) == [("causal", 1024), ("causal", 2048)]
    assert wu._plan(["documents"], None, 2048) == [
        ("documents", 1024), ("documents", 1023), ("documents", 2048), ("documents", 2047)
    ]  # fmt: skip
    # exact lengths are taken as given
    assert wu._plan(["documents", "causal"], [4096], 65536) == [("documents", 4096), ("causal", 4096)]


def test_doc_lengths_fill_the_sequence_with_many_documents():
    gen = torch.Generator().manual_seed(0)
    for total in (1024, 16384, 65536):
        lens = wu._doc_lengths(total, gen)
        assert sum(lens) == total and min(lens) >= 1
        assert len(lens) >= 2


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(head_dim=0), "head_dim"),
        (dict(n_heads=12, n_kv_heads=5), "multiple of n_kv_heads"),
        (dict(dtype=torch.float32), "dtype"),
        (dict(masks=["causal", "diagonal"]), "masks"),
        (dict(masks=["window"]), "window"),
        (dict(max_seq_len=8), "max_seq_len"),
        (dict(device="cpu"), "CUDA"),
        (dict(workers=0), "workers"),
        (dict(lengths=[]), "lengths"),
        (dict(lengths=[4096, 0]), "lengths"),
        (dict(lengths=4096), "lengths"),
        (dict(softcap=-1.0), "softcap"),
        (dict(softcap="30"), "softcap"),
        (dict(masks=["documents_window"]), "window"),
        (dict(workers=2.0), "workers"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        wu.warmup(**kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_cli_without_gpu_says_so(capsys):
    assert cli_main(["warmup", "--preset", "tiny", "--seq-length", "4096"]) == 1
    assert "no CUDA GPU" in capsys.readouterr().err


def test_compile_bench_pieces():
    from longctx.bench import compile as cb

    compile(cb._CHILD, "<child>", "exec")  # the scenario program parses
    extra, share = cb._compile_share([0.1] * 98 + [5.0, 0.1])
    assert extra == pytest.approx(4.8) and share == pytest.approx(4.8 / 14.9)
    # with miss counts, only the batches that compiled count, by their time above the median
    extra, share = cb._compile_share([0.1, 0.1, 0.5, 0.1, 3.0], [0, 0, 0, 0, 2])
    assert extra == pytest.approx(2.9) and share == pytest.approx(2.9 / 3.8)
    names = [n for n, _, _ in cb.scenarios(True, 3, 10.0)]
    assert names == ["cold", "cold_warmup", "lengths", "warm", "packing", "packing_warmup"]
    meta = {"gpu": "G", "torch": "t", "triton": "x", "command": "c"}
    calls = [dict(d=128, h=16, s=16384, mask="documents", seconds=t) for t in (3.0, 0.1, 0.1)]
    res = {"longctx": {"packing": {"process_s": 4.0, "import_s": 0.5, "calls": calls}, "cold": {"error": "boom"}}}
    wu = dict(
        head_dim=64,
        masks=["causal"],
        max_seq_len=4096,
        seconds=3.5,
        compile_s=3.2,
        kernels=4,
        serial_s=9.0,
        failed=["k: RuntimeError: x"],
    )
    res["longctx"]["cold_warmup"] = {"process_s": 9.0, "import_s": 3.0, "warmup_s": 3.5, "warmups": [wu],
                                     "calls": [dict(d=64, h=32, s=4096, mask="causal", seconds=0.01)]}  # fmt: skip
    md = cb._markdown(meta, res)
    assert "warmup D=64 causal S<=4096: 3.50 s (4 kernels compiled in 3.20 s, 9.0 s one after the other)" in md
    assert "did not compile: k: RuntimeError: x" in md and "D=64 causal S=4096: 0.01 s" in md
    assert "3 batches" in md and "1 batches over 2x" in md and "error: `boom`" in md
    assert "cache miss" not in md
    for c, m in zip(calls, (3, 0, 0)):
        c["misses"] = m
    md = cb._markdown(meta, res)
    assert "1 batches met a kernel-cache miss; compiling 2.9 s" in md
