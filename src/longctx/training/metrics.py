"""What a training run reports: ``metrics.jsonl`` (one JSON object per step), the progress line, peak memory.

``metrics.jsonl`` rows hold ``step`` (steps done), ``loss`` (training loss of that step) and ``lr``, plus
``eval_loss`` and ``recall_accuracy`` (recall task) or ``bits_per_byte`` (text) on steps that evaluated. The
file is appended to, so a resumed run continues the rows of the interrupted one.
"""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import torch

__all__ = ["MetricsLog", "Progress", "peak_memory_bytes", "format_bytes", "format_time", "step_line"]


class MetricsLog:
    """Appends one JSON object per step to a ``metrics.jsonl`` file, flushed after every row.

    Args:
        path: the file (its directory is created); None writes nothing, as on ranks other than the first.
    """

    def __init__(self, path: str | Path | None) -> None:
        self._file: IO[str] | None = None
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
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
