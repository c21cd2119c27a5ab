from longctx.cli.main import main

raise SystemExit(main())
