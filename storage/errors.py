"""Store failures a user can fix: a wrong store root, an unknown artifact id, a damaged file."""

from rlvr.errors import UserError


class StoreNotFound(UserError):
    """No store exists at the given root."""


class ArtifactNotFound(UserError):
    """No committed artifact (manifest) has this id."""


class DamagedFile(UserError):
    """A store file (manifest, run record, lease) that cannot be read: the message names it."""


class DamagedArtifact(UserError):
    """A committed artifact whose data no longer matches its manifest (size or sha256): the message names the file."""

    def __init__(self, message: str, artifact_id: str = "", path: str = "") -> None:
        super().__init__(message)
        self.artifact_id = artifact_id
        self.path = path


def unreadable_message(what: str, path: str, exc: BaseException, remedy: str = "") -> str:
    """The one line an unreadable store file gets: which file, why, what to do."""
    reason = (str(exc).splitlines() or [""])[0][:200] or type(exc).__name__
    remedy = remedy or "`rlvr resume RUN_ID` of its run sets it aside and rebuilds the artifact"
    return f"{what} {path} is unreadable ({type(exc).__name__}: {reason}); `rlvr check` lists what is damaged; {remedy}"
