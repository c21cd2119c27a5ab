from longctx.cli import main

raise SystemExit(main())
