"""``python -m longctx.bench.suite`` (what torchrun runs for ``--cp``): the same as ``longctx bench suite``."""

from __future__ import annotations

from longctx.bench.suite.cli import main

raise SystemExit(main())
