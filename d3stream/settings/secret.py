"""A setting whose value must never reach a log line, a traceback or ``--help``.

Settings are printed whole when a worker starts and appear in error messages; a password kept as a plain
``str`` would go with them. ``Secret`` prints as asterisks and gives its value only to the one caller that
asks for it by name (``reveal``): the Kafka connection that signs in with it.
"""

from __future__ import annotations

MASK = "**********"


class Secret:
    """A text that prints as asterisks; ``reveal()`` returns it."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        if not isinstance(value, str):
            raise TypeError(f"a secret is text, got {type(value).__name__}")
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return f"Secret('{MASK}')"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash((Secret, self._value))


def decode_secret(annotation: type, value: object) -> object:
    """msgspec's hook for the one custom type of the settings: text (from a flag, a variable or a file)
    becomes a Secret."""
    if annotation is Secret:
        if isinstance(value, Secret):
            return value
        if not isinstance(value, str):
            raise TypeError(f"a secret is text, got {type(value).__name__}")  # msgspec names the setting
        return Secret(value)
    raise NotImplementedError(f"no settings type {annotation!r}")
