"""User-facing errors (one line that says what was wrong and what to do) and warnings.

Warnings have one channel: the `hybridmoe` logger, whose handler writes "warning: ..." lines to the
current standard error (rich's handler where that is a terminal)."""
from __future__ import annotations

import logging
import sys

log = logging.getLogger("hybridmoe")


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time (so redirected and captured stderr see it too)."""

    def emit(self, record):
        self.stream = sys.stderr
        super().emit(record)


def _handler() -> logging.Handler:
    if sys.stderr.isatty():
        try:
            from rich.logging import RichHandler
            return RichHandler(show_time=False, show_path=False, markup=False)
        except ImportError:
            pass
    h = _StderrHandler()
    h.setFormatter(_Lower())
    return h


class _Lower(logging.Formatter):
    def format(self, record):
        return f"{record.levelname.lower()}: {record.getMessage()}"


def warn(message: str) -> None:
    """One warning line for the user."""
    if not log.handlers:
        log.addHandler(_handler())
        log.propagate = False
    log.warning(message)


def warn_fallback(what: str, err: Exception, instead: str) -> None:
    """The warning when a fast path fails at run time and a slower, correct one takes over."""
    first = str(err).splitlines()[0] if str(err) else ""
    warn(f"{what} failed ({type(err).__name__}: {first}); {instead}")


class HybridMoeError(Exception):
    """Base class for errors shown to the user as one line (no traceback)."""


class ModelFileError(HybridMoeError):
    """A model file is malformed, truncated or unsupported."""

    def __init__(self, path, problem: str, hint: str = ""):
        msg = f"{path}: {problem}"
        if hint:
            msg += f" ({hint})"
        super().__init__(msg)
        self.path = str(path)


class PlacementError(HybridMoeError):
    """A placement rule is invalid or the placement does not fit."""
