"""`longctx bench cp`: context-parallel attention on several GPUs (run under torchrun).

    torchrun --nproc-per-node 2 -m longctx.bench.cp --check            # NCCL bf16 correctness, then the sweep
    torchrun --nproc-per-node 2 -m longctx.bench.cp --tokens-per-gpu 8192,16384 --methods ring

Throughput: per-GPU TFLOP/s of forward+backward of `cp_attention` for every method and layout, at total
lengths S = P x tokens-per-GPU, against the single-GPU kernel (`longctx.attention` with the same launcher
backend) on tokens-per-GPU tokens. FLOPs: forward ``4 B Hq S^2 D`` (halved for causal), backward 2.5x
forward; per-GPU figures divide by P. Times: wall clock between device syncs over a fixed number of calls
(the same on every rank: collectives), the slowest rank's mean.

``--check``: the same `cp_attention` in bf16 against a float64 oracle (`longctx.attention(backend="math")` on
the whole sequence, float64) next to the single-GPU bf16 kernel on the whole sequence, for out, dq, dk, dv:
pass when ``err(cp) <= 2 err(single GPU) + 1e-5`` (the FlashAttention rule).

``--max-seq``: the longest sequence that trains the 350M GPT (preset gpt2-medium, full recomputation uniform
1 layer, bf16 autocast, AdamW) on 1, ..., P GPUs (``--max-seq-gpus``; subgroups of the world, ring/zigzag)
under a memory cap per GPU (``--mem-cap-gib``, default 16): full GPU memory would need steps of minutes.
Each try is one whole training step; the search doubles, then bisects to ``--max-seq-res`` within
``--max-seq-budget-s``. Reported: the longest S measured to fit, the shortest measured not to, GiB per 1K
tokens per GPU (a line through the peaks of the tries that fit), and that line extrapolated to the whole GPU,
labelled as such. The cap is enforced by all ranks together at layer boundaries (`_CapWatch`), so a try over
it stops on every rank at once and no rank is left waiting in a ring exchange.

Writes ``benchmarks/results/cp_<gpu>x<P>[<tag>].md`` and ``.json`` (rank 0; ``--out-dir``, ``--tag``),
overwriting the previous run on that GPU count. All stages on 4 GPUs in one go: ``bash dev/cp_suite.sh``.

Modules: `common` (names, syncs, the rank-0 log), `check`, `throughput` (attention timing), `search` (the
longest-sequence search), `max_seq` (the GPT step under a memory cap), `report` (Markdown and JSON), `main`.
"""

from __future__ import annotations

from longctx.bench.cp.main import main, parser
from longctx.bench.cp.max_seq import _final_hidden, _output_weight, chunked_lm_loss_sum, run_max_seq
from longctx.bench.cp.report import _max_seq_markdown, markdown
from longctx.bench.cp.search import QUANTUM, search_longest

__all__ = [
    "QUANTUM",
    "_final_hidden",
    "_max_seq_markdown",
    "_output_weight",
    "chunked_lm_loss_sum",
    "main",
    "markdown",
    "parser",
    "run_max_seq",
    "search_longest",
]
