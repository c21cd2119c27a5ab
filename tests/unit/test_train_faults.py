"""Fault injection: a `longctx train` process killed at random points (during a step, during a checkpoint write, by
SIGTERM) again and again; every time the checkpoint on disk is whole, and ``--resume`` ends with exactly the losses
of an uninterrupted run."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from longctx.training.checkpoint import load_checkpoint

ARGS = [
    "--preset", "tiny", "--micro-batch-size", "2", "--num-keys", "16", "--num-values", "16", "--eval-iters", "1",
    "--eval-interval", "10", "--quiet", "--device", "cpu", "--attention-backend", "math", "--hidden-dropout", "0.1",
    "--train-iters", "30", "--save-interval", "4",
]  # fmt: skip

# The training process with two widened windows, so that a kill lands inside them: a pause between a step's
# backward and its optimizer step, and one before the fsync of a checkpoint's temporary file.
WRAPPER = """
import os, sys, time
from longctx.training import trainer
step_pause, save_pause = float(os.environ["STEP_PAUSE"]), float(os.environ["SAVE_PAUSE"])
fsync = os.fsync
def slow_fsync(fd):
    time.sleep(save_pause)
    fsync(fd)
os.fsync = slow_fsync
forward_backward = trainer.Trainer.forward_backward
def slow_forward_backward(self, batch):
    loss = forward_backward(self, batch)
    time.sleep(step_pause)
    return loss
trainer.Trainer.forward_backward = slow_forward_backward
sys.exit(trainer.main(sys.argv[1:]))
"""


def _losses(save: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (save / "metrics.jsonl").read_text().splitlines()]


def _rows(save: Path) -> int:
    path = save / "metrics.jsonl"
    return path.read_text().count("\n") if path.exists() else 0


def _wait_for(condition, proc: subprocess.Popen, timeout: float = 120.0) -> bool:
    """Poll ``condition`` until it holds (True) or the process ends (False)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.002)
    raise TimeoutError("the training process made no progress")


def _start(wrapper: Path, save: Path, step_pause: float, save_pause: float) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # the Trainer's own thread rule
    env.update(STEP_PAUSE=str(step_pause), SAVE_PAUSE=str(save_pause))
    resume = ["--resume"] if (save / "checkpoint.pt").exists() else ["--overwrite"]
    cmd = [sys.executable, str(wrapper), *ARGS, "--save", str(save), *resume]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def test_killed_again_and_again_resume_gives_the_losses_of_an_uninterrupted_run(tmp_path):
    wrapper = tmp_path / "train.py"
    wrapper.write_text(WRAPPER)
    reference = _start(wrapper, tmp_path / "reference", 0.0, 0.0)
    assert reference.wait(timeout=300) == 0, reference.stderr.read()
    expected = _losses(tmp_path / "reference")
    assert len(expected) == 30

    save = tmp_path / "run"
    rng = random.Random(25)
    kills = {"step": 0, "write": 0, "sigterm": 0}
    for mode in ["step", "write", "step", "sigterm", "write", "step", "write"]:
        proc = _start(wrapper, save, step_pause=0.04, save_pause=0.25)
        before = _rows(save)
        try:
            if mode == "write":  # inside a checkpoint write: its temporary file exists, the rename has not happened
                hit = _wait_for(lambda: any(save.glob("checkpoint.pt.*.tmp")), proc)
            else:  # during a step, a random time after some progress
                target = before + rng.randint(1, 3)
                hit = _wait_for(lambda t=target: _rows(save) >= t, proc)
                time.sleep(rng.uniform(0.0, 0.04))
            if hit:
                proc.send_signal(signal.SIGTERM if mode == "sigterm" else signal.SIGKILL)
            code = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
        if not hit:  # the run ended before the fault could be injected
            assert code == 0, proc.stderr.read()
            break
        kills[mode] += 1
        if mode == "sigterm":
            assert code == 143 and "is intact; continue with --resume" in proc.stderr.read()
        else:
            assert code == -signal.SIGKILL
        if (save / "checkpoint.pt").exists():  # never partial: it loads, and its checksums hold
            assert 1 <= load_checkpoint(save / "checkpoint.pt")["step"] <= 30

    assert kills["step"] >= 2 and kills["write"] >= 2 and kills["sigterm"] == 1, kills
    final = _start(wrapper, save, 0.0, 0.0)
    assert final.wait(timeout=300) == 0, final.stderr.read()
    assert not list(save.glob("*.tmp"))
    assert _losses(save) == expected  # exactly: the same weights, optimizer state, data and dropout
