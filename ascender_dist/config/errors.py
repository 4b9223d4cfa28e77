"""The one error type every configuration problem raises.

Messages are a single line that starts with the dotted path of the offending field
(``model.ascender.k: must be <= window (got 64 > 32)``) so a user never has to read a traceback.
"""


class ConfigError(ValueError):
    """A configuration value is missing, mistyped or inconsistent. ``str(e)`` is one line."""

    def __init__(self, path: str, message: str):
        self.path = path
        self.message = message
        super().__init__(f"{path}: {message}" if path else message)
