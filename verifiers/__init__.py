"""Reward functions: the verifier contract, one module per domain, and the registry."""
