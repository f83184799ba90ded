"""`python -m rlvr.flows.cli`: the same as the `rlvr` command."""

from rlvr.flows.cli.commands import main

main()
