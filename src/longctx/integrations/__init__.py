"""longctx inside other ecosystems' models, one module per ecosystem (each imports its ecosystem on import).

- `longctx.integrations.transformers`: HuggingFace transformers. Importing it registers the attention
  implementation ``"longctx"``; ``apply(model, ...)`` adds recomputation, offloading, the logits-free loss and
  context parallelism to a causal LM.

Nothing here is imported by ``import longctx``: the ecosystems are optional dependencies.
"""

from __future__ import annotations

__all__: list[str] = []
