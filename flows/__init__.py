"""Prefect flows (the RL run) and the `rlvr` command line."""
