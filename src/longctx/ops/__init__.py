"""The launchers as `torch.library` custom ops with autograd and fake implementations, so `torch.compile` traces a
model through them and a selective-recompute policy can name them: `flash` (dense), `sparse` (block masks)."""
