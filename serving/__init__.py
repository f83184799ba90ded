"""Serving a model over HTTP: what `rlvr serve-rm` runs (docs/rewards.md)."""
