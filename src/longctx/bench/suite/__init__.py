"""``longctx bench suite``: the Long-Context Attention Benchmark (LongCA-bench's conventions) as one command.

Kernel mode (one GPU): forward and backward TFLOP/s, wall time and peak extra memory of every provider on every
mask of the catalogue (`longctx.masks.catalogue`) at every length. FLOPs count the mask's kept area: forward
``4 x area x Hq x D``, backward 2.5x forward. Defaults: batch 1, 64 query / 8 kv heads, head dim 128, bf16,
S = 4K, 16K, 64K, document masks over seeds 0, 1, 2. Out of memory and "unsupported" are result codes, never a
crash. Also: the time to build each mask at the largest S, longctx's builder against Flex's create_block_mask.

Context-parallel mode (``--cp``, under torchrun; gloo on the CPU for tiny shapes): per-GPU TFLOP/s of each method
on each mask at a fixed number of tokens per GPU, the slowest rank's time, against the single-GPU kernel.

Each run writes one folder (default ``benchmarks/results/suite_<gpu>/``): ``results.csv``, ``results.json``,
``summary.md`` and PNG plots. ``--quick`` runs the same code on the CPU with tiny shapes (CI)::

    longctx bench suite                                    # the full kernel mode (GPU)
    longctx bench suite --quick --out /tmp/suite           # the CPU version
    longctx bench suite --masks causal,causal_document --providers longctx_triton_sparse,flex --s 16384
    torchrun --nproc-per-node 8 -m longctx.bench.suite --cp --tokens-per-gpu 8192

Parts: `case` (a measurement's facts, result codes), `providers/` (one file per provider and the registry),
`kernel` (kernel mode), `cp` (context-parallel mode and its method registry), `report` (the folder), `cli`.
"""

from __future__ import annotations

from longctx.bench.suite.cli import main

__all__ = ["main"]
