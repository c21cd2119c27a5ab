"""`longctx train`: configuration, the trainer, data, checkpoints and metrics."""
