"""Benchmarks reachable as `longctx bench <name>` (and `python -m longctx.bench.masks`).

Each writes its report to ``<out-dir>/<benchmark>_<gpu>[<tag>].{md,json}``: the latest run per GPU and
benchmark, overwriting the previous one (git keeps the history of ``benchmarks/results/``).
"""

from __future__ import annotations

import os

__all__ = ["result_stem"]


def result_stem(out_dir: str, benchmark: str, gpu: str, tag: str = "") -> str:
    """``<out_dir>/<benchmark>_<gpu><tag>`` with the GPU name as a file name: no "NVIDIA ", dashes for spaces.

    ``tag`` names what a run covers (``"_64k"``, ``"_check"``), never when it ran.
    """
    name = gpu.replace("NVIDIA ", "").replace(" ", "-").replace("/", "-")
    return os.path.join(out_dir, f"{benchmark}_{name}{tag}")
