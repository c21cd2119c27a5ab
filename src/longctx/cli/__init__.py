"""The `longctx` command: `main` parses the subcommand; `commands` holds info, check and demo-memory."""

from __future__ import annotations

from longctx.cli.main import main

__all__ = ["main"]
