"""The base of every error a user can fix, and the one error type every configuration problem raises.

Messages are a single line that starts with the dotted path of the offending field
(``model.ascender.k: must be <= window (got 64 > 32)``) so a user never has to read a traceback.
"""


class UserError(Exception):
    """Bad input or a state the user must act on (a config field, a data file, a checkpoint, a
    diverging run). ``str(e)`` is one line; every entry point prints it as ``error: ...`` and exits
    with status 2 instead of a traceback. Each package's error type derives from it."""


class ConfigError(UserError, ValueError):
    """A configuration value is missing, mistyped or inconsistent. ``str(e)`` is one line."""

    def __init__(self, path: str, message: str):
        self.path = path
        self.message = message
        super().__init__(f"{path}: {message}" if path else message)
