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
        self.path = printable(path)
        self.message = printable(message)
        super().__init__(f"{self.path}: {self.message}" if self.path else self.message)


def printable(text: str) -> str:
    """``text`` with each character a terminal would act on (a newline, an escape) written as its
    Python escape: a key or value from the file (``"hidden\\nsize"``) keeps the message one line."""
    text = str(text)
    return text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def non_finite_field(obj) -> "tuple[str, float] | None":
    """(name, value) of the first float field of dataclass ``obj`` that is NaN or infinite, else None.
    The hyper-parameter classes refuse such values: ``<`` / ``>`` checks pass NaN, and a config.json
    (Python's json reads NaN and Infinity) reaches them without the YAML loader's check."""
    import dataclasses
    import math

    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            return f.name, value
    return None
