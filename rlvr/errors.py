"""Expected failures. The CLI prints a `UserError` (or a failure of the machine: `environment_failure`) as one
line and exits non-zero; anything else is a bug."""

import errno

__all__ = [
    "ConfigError",
    "RunTakenOver",
    "Stopped",
    "UserError",
    "environment_failure",
    "stop_reason",
    "stop_with",
]


class UserError(Exception):
    """A failure caused by input or environment that the user can fix (the message says how)."""


class ConfigError(UserError):
    """The run configuration is malformed (unknown key, wrong type, bad value)."""


class Stopped(BaseException):
    """A run stopped by a signal: SIGTERM (`timeout`, a batch scheduler, a container stopping), raised in the run's
    main thread, or Ctrl-C, which the CLI turns into this. It unwinds the run (its record says failed, its lease
    is released), then the CLI exits with `status` at once, without waiting for stage threads still computing:
    the store is safe to leave at any moment, as after SIGKILL."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


_stop_reasons: dict[int, str] = {}


def stop_with(signum: int, reason: str) -> None:
    """Say why the process is about to send itself `signum` (e.g. a data-parallel rank died), so that the run
    stopping on it names that reason rather than the signal."""
    _stop_reasons[signum] = reason


def stop_reason(signum: int, default: str) -> str:
    """What stopped the run on `signum`: the reason `stop_with` gave, else `default`."""
    return _stop_reasons.get(signum, default)


class RunTakenOver(Stopped):
    """A run whose lease another process took over (storage/leases.py: this one was frozen past the heartbeat
    timeout): it stops at once, writing nothing more to the run, not even its record, and the CLI prints the
    message (which names the run and its new owner) as one line and exits with status 2."""

    def __init__(self, message: str) -> None:
        super().__init__(message, 2)


def environment_failure(exc: BaseException) -> str | None:
    """What failed on the machine rather than in the code (a full disk, a read-only file system, a file the
    process may not write), found anywhere in the exception's chain, as a few words; None for anything else,
    which keeps its traceback (a bug)."""
    for cause in _chain(exc):
        line = _environment_line(cause)
        if line is not None:
            return line
    return None


def _environment_line(exc: BaseException) -> str | None:
    where = f" ({exc.filename})" if isinstance(exc, OSError) and exc.filename else ""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"no space left on the device{where}"
    if isinstance(exc, OSError) and exc.errno == errno.EROFS:
        return f"the file system is read-only{where}"
    if isinstance(exc, PermissionError) and exc.filename:
        return f"permission denied{where}"
    if type(exc).__name__ == "OperationalError" and "disk is full" in str(exc):  # sqlite3: Prefect's database
        return "no space left on the device (Prefect's database)"
    return None


def _chain(exc: BaseException) -> list[BaseException]:
    """The exception, its causes and the exceptions it was raised while handling, each once."""
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in seen:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen
