"""``python -m longctx.bench.cp`` (and ``torchrun ... -m longctx.bench.cp``): see the package docstring."""

from longctx.bench.cp.main import main

raise SystemExit(main())
