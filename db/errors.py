"""The database layer's error a user fixes, apart from ``db.session`` so that the ``tuner``
command can catch it without importing SQLAlchemy (0.3 s on the 2-core CPU machine, measured
with ``python -X importtime``; issue 41, item 1)."""

from __future__ import annotations

__all__ = ["DatabaseUnavailableError"]


class DatabaseUnavailableError(RuntimeError):
    """The database of a URL cannot be used at all: a SQLite file in a folder that does not
    exist, or a first connection that failed (server down, wrong host, refused login).
    ``message`` names the URL (never its password) and the reason; ``fix`` what to do."""

    def __init__(self, message: str, fix: str) -> None:
        super().__init__(f"{message} ({fix})")
        self.message = message
        self.fix = fix
