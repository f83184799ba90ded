"""Environments: the contract an episode is played through, the registry, the built-in environments, the tools
they run, and the adapters for environments written elsewhere (docs/environments.md)."""
