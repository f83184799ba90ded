"""Store failures a user can fix: a wrong store root, an unknown artifact id."""

from rlvr.errors import UserError


class StoreNotFound(UserError):
    """No store exists at the given root."""


class ArtifactNotFound(UserError):
    """No committed artifact (manifest) has this id."""
