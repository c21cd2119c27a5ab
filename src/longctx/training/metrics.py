"""What a training run reports: ``metrics.jsonl`` (one JSON object per step), ``loss.png``, the progress line.

``metrics.jsonl`` in the run folder (``--save``) holds one row per step of one run, in order:

    {"step": 12, "loss": 2.0794, "lr": 0.0024}                                    every step
    {"step": 250, ..., "eval_loss": 1.21, "recall_accuracy": 0.53}               evaluation steps (recall task)
    {"step": 250, ..., "eval_loss": 1.70, "bits_per_byte": 2.45}                 evaluation steps (text)
    {"step": 13, "loss": null, "lr": 0.0024, "skipped": "non-finite loss ..."}   a step skipped (--on-nonfinite skip)

``step`` counts the steps done (1 after the first). A fresh run starts the file; a resumed run first drops the
rows after its checkpoint's step (steps the interrupted run did after its last checkpoint, which the resumed run
repeats), so every step appears once. At the end of a run `plot_metrics` draws ``loss.png`` beside it.
"""

from __future__ import annotations

import collections
import json
import os
import resource
import sys
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import torch

__all__ = [
    "MetricsLog",
    "Progress",
    "read_metrics",
    "plot_metrics",
    "peak_memory_bytes",
    "format_bytes",
    "format_time",
    "step_line",
]


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl`` file (a torn last line, from a process killed mid-write, is ignored)."""
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


class MetricsLog:
    """Writes one JSON object per step to a ``metrics.jsonl`` file, flushed after every row.

    Args:
        path: the file (its directory is created); None writes nothing, as on ranks other than the first.
        resume_from: None starts a new file; a step keeps the rows up to that step (a resumed run) and appends.
    """

    def __init__(self, path: str | Path | None, resume_from: int | None = None) -> None:
        self._file: IO[str] | None = None
        if path is not None:
            path = Path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            kept = [] if resume_from is None or not path.exists() else read_metrics(path)
            kept = [r for r in kept if isinstance(r.get("step"), int) and r["step"] <= (resume_from or 0)]
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
            os.replace(tmp, path)  # the kept rows, or an empty file, never a half-rewritten one
            self._file = open(path, "a")  # noqa: SIM115 (closed by close() or the with-block)

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` as one line of JSON."""
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        """Close the file (writing after this does nothing)."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class Progress:
    """One line, rewritten in place on a terminal and printed every ``log_interval`` steps otherwise.

    Args:
        total: the step count the bar fills up to.
        quiet: print nothing.
        log_interval: steps between printed lines when stdout is not a terminal.
    """

    def __init__(self, total: int, quiet: bool, log_interval: int) -> None:
        self.total, self.quiet, self.log_interval = total, quiet, max(1, log_interval)
        self.tty = sys.stdout.isatty()

    def update(self, step: int, text: str, force: bool = False) -> None:
        """Show ``text`` after a bar at ``step`` (steps done); ``force`` prints it even between intervals."""
        if self.quiet:
            return
        done = step / self.total
        width = 20
        bar = "#" * int(done * width) + "." * (width - int(done * width))
        line = f"[{bar}] {step}/{self.total} | {text}"
        if self.tty:
            print("\r" + line + "\x1b[K", end="" if step < self.total else "\n", flush=True)
        elif force or step % self.log_interval == 0 or step == self.total:
            print(line, flush=True)

    def message(self, text: str) -> None:
        """Print ``text`` on lines of its own."""
        if not self.quiet:
            print(("\n" if self.tty else "") + text, flush=True)


def plot_metrics(metrics_path: str | Path, png_path: str | Path | None = None) -> tuple[Path | None, str]:
    """Draw the loss curve of a ``metrics.jsonl`` (training loss per step, held-out loss where evaluated) as a PNG.

    Args:
        metrics_path: the metrics file.
        png_path: where to write; default ``loss.png`` beside the metrics file.

    Returns:
        ``(path written, "")``, or ``(None, why not)`` when matplotlib is missing or there is nothing to draw.
    """
    metrics_path = Path(metrics_path)
    png = Path(png_path) if png_path is not None else metrics_path.with_name("loss.png")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None, "matplotlib is not installed (pip install matplotlib, or longctx[dev]): no loss.png"
    rows = read_metrics(metrics_path) if metrics_path.exists() else []
    train = [(r["step"], r["loss"]) for r in rows if isinstance(r.get("loss"), (int, float))]
    held_out = [(r["step"], r["eval_loss"]) for r in rows if isinstance(r.get("eval_loss"), (int, float))]
    if not train:
        return None, "no finite losses in the metrics file: no loss.png"
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*zip(*train), lw=1, label="training loss")
    if held_out:
        ax.plot(*zip(*held_out), "o-", label="held-out loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(str(metrics_path.parent.name or metrics_path.parent))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = png.with_name(png.name + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, png)
    return png, ""


def peak_memory_bytes(device: torch.device) -> int:
    """``torch.cuda.max_memory_allocated`` on a GPU; the peak RSS of the process on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def format_bytes(n: float) -> str:
    """``n`` bytes in B, KiB, MiB or GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit in ("B", "KiB") else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def format_time(seconds: float) -> str:
    """``seconds`` as MM:SS."""
    s = int(seconds)
    return f"{s // 60:02d}:{s % 60:02d}"


class RecentRate:
    """Steps per second over the last ``window`` steps (fewer at the start): what the progress line prints, so the
    compile and warm-up of the first steps do not drag the throughput of a long run for hundreds of steps."""

    def __init__(self, window: int = 10) -> None:
        self.window = window
        self.marks: collections.deque[tuple[int, float]] = collections.deque(maxlen=window + 1)

    def mark(self, step: int, when: float) -> None:
        """Record that ``step`` steps were done at time ``when`` (seconds, any monotonic clock)."""
        self.marks.append((step, when))

    def skip(self, seconds: float) -> None:
        """Leave out ``seconds`` spent since the last mark on something else (an evaluation)."""
        self.marks = collections.deque(((s, t + seconds) for s, t in self.marks), maxlen=self.window + 1)

    def steps_per_second(self) -> float:
        if len(self.marks) < 2:
            return 0.0
        (s0, t0), (s1, t1) = self.marks[0], self.marks[-1]
        return (s1 - s0) / max(t1 - t0, 1e-9)


def step_line(
    loss: float,
    lr: float,
    tokens_per_second: float,
    peak_bytes: int,
    last_eval: dict[str, float],
    elapsed: float,
    eta: float,
) -> str:
    """The progress text after a step: loss, learning rate, throughput, peak memory, the last evaluation, time."""
    text = f"loss {loss:.4f} | lr {lr:.2e} | {tokens_per_second / 1e3:.1f}k tok/s | peak {format_bytes(peak_bytes)}"
    if "recall_accuracy" in last_eval:
        text += f" | eval recall {last_eval['recall_accuracy']:.1%}"
    elif "eval_loss" in last_eval:
        text += f" | eval loss {last_eval['eval_loss']:.3f}"
    return text + f" | {format_time(elapsed)} < {format_time(eta)}"
