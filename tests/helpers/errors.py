"""What every bad-input test asserts about an error: one line, the right type, naming the culprit."""

from __future__ import annotations


def one_line(error, *needles: str, kind: type = BaseException) -> str:
    """The message of ``error`` (an exception, or pytest's ExceptionInfo of one), asserted to be a
    single line of an exception of type ``kind`` that contains every needle; returned."""
    exc = getattr(error, "value", error)
    message = str(exc)
    assert isinstance(exc, kind), (type(exc), message)
    assert "\n" not in message, message
    for needle in needles:
        assert needle in message, (needle, message)
    return message
