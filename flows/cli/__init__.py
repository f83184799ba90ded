"""The `rlvr` command line: the typer app and its commands (commands.py; the data commands, `rlvr check` and
`rlvr serve-rm` in their own modules), their shared set-up (common.py). Usage: README, docs/, `rlvr --help`."""

from rlvr.flows.cli.commands import app, main

__all__ = ["app", "main"]
