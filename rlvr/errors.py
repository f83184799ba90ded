"""Expected failures. The CLI prints a `UserError` as one line and exits non-zero; anything else is a bug."""


class UserError(Exception):
    """A failure caused by input or environment that the user can fix (the message says how)."""


class ConfigError(UserError):
    """The run configuration is malformed (unknown key, wrong type, bad value)."""
