"""The one error type the tuner shows to people: what went wrong and how to fix it."""

from __future__ import annotations

__all__ = ["TunerError"]


class TunerError(Exception):
    """A problem the user can fix (bad spec, unknown suite, bad bundle, ...).

    ``fix`` says what to do about it; the CLI prints both and exits non-zero.
    """

    def __init__(self, message: str, fix: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.fix = fix

    def __str__(self) -> str:
        return f"{self.message} ({self.fix})" if self.fix else self.message
