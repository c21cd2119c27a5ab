"""`longctx train`, in the parts torchtitan's components/ would have.

- `longctx.training.config`: `TrainConfig` and `parse_config` (flags and YAML, Megatron and NeMo names).
- `longctx.training.trainer`: `Trainer` (its `train_step` is one optimiser step), `run` and the command's `main`.
- `longctx.training.data`: the embedded recall task and byte-level text, batches a pure function of the step.
- `longctx.training.checkpoint`: atomic checkpoints and exact resume.
- `longctx.training.metrics`: ``metrics.jsonl``, the progress line, peak memory.
"""
