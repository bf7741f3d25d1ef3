"""TUNER_LOG_LEVEL for the project's own loggers (``tuner``, ``templates``, ``db``, ``api``).

A library leaves logging to its application, so nothing is configured unless TUNER_LOG_LEVEL
is set: then the `tuner` command and ``import tuner`` set those loggers to that level and, if
the application has configured no logging (the root logger has no handler), send their
records to stderr. Before, the variable reached uvicorn alone and DEBUG showed nothing of
``tuner.attention``'s config lookups (issue 20).
"""

from __future__ import annotations

import logging
import sys

__all__ = ["PROJECT_LOGGERS", "configure_logging"]

PROJECT_LOGGERS = ("tuner", "templates", "db", "api")
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is when a record comes (as ``logging.lastResort``
    does), so that a replaced stderr (pytest's capture, a redirect) is followed."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter(FORMAT))

    @property  # type: ignore[override]
    def stream(self) -> object:
        return sys.stderr

    @stream.setter
    def stream(self, _value: object) -> None:
        pass  # StreamHandler.__init__ assigns one: the property above answers instead


def configure_logging(level: str) -> None:
    """Set the project's loggers to ``level`` (a name such as "DEBUG"); give them a stderr
    handler unless the application has one on the root logger. Calling it again only changes
    the level."""
    needs_handler = not logging.getLogger().handlers
    for name in PROJECT_LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(level)
        if needs_handler and not any(isinstance(h, _StderrHandler) for h in logger.handlers):
            logger.addHandler(_StderrHandler())
