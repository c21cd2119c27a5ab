"""`longctx train --context-parallel 2` under torchrun (gloo): ranks started with different settings (the mesh
sizes included), or settings that every rank rejects (a world size other than dp x cp), end on every rank with
its own message and exit status 2, without a hang or an abort; SIGTERM stops both ranks after the same step with
one (sharded) checkpoint."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from longctx.training.checkpoint import read_sharded_meta

pytestmark = pytest.mark.distributed

ARGS = [
    "--preset", "tiny", "--micro-batch-size", "2", "--num-keys", "16", "--num-values", "16", "--eval-iters", "1",
    "--quiet", "--attention-backend", "tiled", "--context-parallel", "2",
]  # fmt: skip

# Each rank appends the flags of EXTRA_RANK<rank>: how a test starts the ranks with different settings.
WRAPPER = """
import os, sys
from longctx.training.trainer import main
sys.exit(main(sys.argv[1:] + os.environ.get("EXTRA_RANK" + os.environ["RANK"], "").split()))
"""


def _torchrun(tmp_path: Path, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    wrapper = tmp_path / "train.py"
    wrapper.write_text(WRAPPER)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(wrapper), *ARGS, *argv]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the ranks hung: {err[-2000:]}")
    return proc.returncode, out + err


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"EXTRA_RANK1": "--num-layers 3"}, "num_layers: rank 0 has 2, rank 1 has 3"),
        ({"EXTRA_RANK1": "--seed 7"}, "seed: rank 0 has 1234, rank 1 has 7"),
        ({"EXTRA_RANK0": "--seq-length 66", "EXTRA_RANK1": "--seq-length 66"}, "sequence length"),
        (
            {"EXTRA_RANK0": "--data-parallel 2", "EXTRA_RANK1": "--data-parallel 2"},
            "--data-parallel 2 x --context-parallel 2 needs 4 processes, got world size 2",
        ),
        ({"EXTRA_RANK1": "--data-parallel 2 --context-parallel 1"}, "context_parallel: rank 0 has 2, rank 1 has 1"),
    ],
    ids=["num_layers", "seed", "seq_length_every_rank", "world_not_dp_times_cp", "mesh_differs"],
)
def test_ranks_that_cannot_train_together_each_exit_with_their_own_message(tmp_path, extra, message):
    code, output = _torchrun_result(tmp_path, extra)
    assert code != 0
    for rank in (0, 1):  # one whole line per rank: the ranks' messages never share a line
        line = re.search(rf"^\[rank {rank}\] longctx train: error: .*$", output, re.MULTILINE)
        assert line is not None and message in line.group(0), output[-3000:]
        assert line.group(0).count("longctx train:") == 1
    # a clean exit 2 (torchrun may stop the other rank with SIGTERM once the first has exited: after its message,
    # so both messages above are always there), never an abort
    assert "exitcode  : 2" in output, output[-3000:]
    assert "Signals.SIGABRT" not in output and "exitcode  : -6" not in output


def _torchrun_result(tmp_path: Path, extra: dict[str, str]) -> tuple[int, str]:
    return _finish(_torchrun(tmp_path, ["--train-iters", "3", "--save", str(tmp_path / "run")], extra))


def test_sigterm_stops_both_ranks_after_the_same_step_with_a_checkpoint(tmp_path):
    save = tmp_path / "run"
    proc = _torchrun(tmp_path, ["--train-iters", "100000", "--save-interval", "0", "--save", str(save)])
    metrics = save / "metrics.jsonl"
    end = time.monotonic() + 120
    while not (metrics.exists() and metrics.read_text().count("\n") >= 3):
        assert proc.poll() is None and time.monotonic() < end, "the run did not start"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # torchrun forwards it to both ranks, as a cluster's preemption does
    code, output = _finish(proc)
    assert code != 0 and "[rank 0] longctx train: SIGTERM: stopped after step" in output, output[-3000:]
    step = int(re.search(r"stopped after step (\d+)", output).group(1))
    assert read_sharded_meta(save / "checkpoint")["step"] == step  # sharded: every rank wrote its part
    assert metrics.read_text().count("\n") == step
