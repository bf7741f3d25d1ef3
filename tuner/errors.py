"""The tuner's errors: what went wrong and how to fix it (``TunerError``), and the kinds a
caller may tell apart (``ServiceError``: the config service's answer; ``tuner.settings``'
``SettingsError``; ``tuner.lookup.snapshot``'s ``SnapshotError``). The database layer, which imports
nothing of the tuner's, has its own (``db.errors.DatabaseUnavailableError``, with the same
``message`` and ``fix``)."""

from __future__ import annotations

__all__ = ["ServiceError", "TunerError"]


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


class ServiceError(TunerError):
    """The config service refused, failed, or could not be reached (``status`` None); ``detail``
    is the service's explanation (``tuner.client``)."""

    def __init__(self, message: str, *, status: int | None = None, detail: object = None,
                 fix: str = "") -> None:
        super().__init__(message, fix)
        self.status = status
        self.detail = detail
