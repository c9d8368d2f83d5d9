"""User-facing errors (one line that says what was wrong and what to do) and warnings.

Warnings have one channel: the `hybridmoe` logger, whose handler writes "warning: ..." lines to the
current standard error (rich's handler where that is a terminal)."""
from __future__ import annotations

import contextlib
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


_progress_depth = 0       # a progress bar is showing (an inner one stays hidden: one live display at a time)


class Progress:
    """What a progress() block advances; does nothing where no bar is shown."""

    def __init__(self, prog=None, task=None, title: str = ""):
        self.prog, self.task, self.title = prog, task, title

    def advance(self, n: float = 1):
        if self.prog is not None:
            self.prog.advance(self.task, n)

    def describe(self, text: str):
        if self.prog is not None:
            self.prog.update(self.task, description=f"{self.title}: {text}" if self.title else text)


@contextlib.contextmanager
def progress(title: str, total: float, unit: str = "", enabled: bool | None = None):
    """A transient rich progress bar on stderr for long work (loading, converting, calibrating): by default
    shown only where stderr is a terminal (never in piped or captured output); enabled=False hides it, True
    shows it anyway (bench --progress). Never inside another bar: the outer one stays the only one.
    unit "bytes": sizes and a rate instead of a count."""
    global _progress_depth
    show = (sys.stderr.isatty() if enabled is None else enabled) and total > 0 and _progress_depth == 0
    _progress_depth += 1
    try:
        if not show:
            yield Progress()
            return
        from rich.console import Console
        from rich import progress as rp
        count = [rp.DownloadColumn(binary_units=True), rp.TransferSpeedColumn()] if unit == "bytes" else \
            [rp.MofNCompleteColumn()]
        # stdout on the same terminal and warnings print above the bar; redirected stdout is never touched
        bar = rp.Progress(rp.TextColumn("{task.description}"), rp.BarColumn(), *count, rp.TimeElapsedColumn(),
                          console=Console(stderr=True), transient=True, redirect_stdout=sys.stdout.isatty(),
                          redirect_stderr=True, refresh_per_second=4)
        with bar:
            yield Progress(bar, bar.add_task(title, total=total), title)
    finally:
        _progress_depth -= 1


class HybridMoeError(Exception):
    """Base class for errors shown to the user as one line (no traceback)."""


MAX_MESSAGE = 280          # a model file error is one line of at most this many characters


def printable(value, limit: int = 80) -> str:
    """`value` (a name or value read from an untrusted file) as a short, printable, quoted string: control
    and non-printable characters escaped, at most `limit` characters of it kept (the middle elided)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        value = bytes(value[:4 * limit]).decode("utf-8", errors="replace")
    elif hasattr(value, "__index__") or isinstance(value, float) or type(value).__name__.startswith("float"):
        return str(value)[:limit]                     # a number (numpy's too), unquoted
    elif not isinstance(value, str):
        return _short_repr(value, limit)
    n = len(value)
    if n > limit:
        value = value[:limit * 2 // 3] + "\u2026" + value[n - limit // 3:]
    text = repr(value)
    if n > limit:
        text += f" ({n} characters)"
    return text


def _short_repr(value, limit: int) -> str:
    """A bounded description of a metadata value that is not a string or a number (an array, ...)."""
    try:
        n = len(value)
    except TypeError:
        return type(value).__name__
    kind = getattr(getattr(value, "dtype", None), "name", None) or type(value).__name__
    head = ", ".join(str(v)[:16] for v in list(value[:3]))
    return f"{kind}[{n}]: [{head}{', ...' if n > 3 else ''}]"[:limit]


def one_line(text: str, limit: int = MAX_MESSAGE) -> str:
    """`text` on one line of printable characters, at most `limit` long (the middle elided)."""
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in " ".join(str(text).split()))
    if len(text) > limit:
        text = text[:limit * 3 // 4 - 1] + "\u2026" + text[len(text) - limit // 4:]
    return text


class ModelFileError(HybridMoeError):
    """A model file is malformed, truncated or unsupported: one printable line of at most MAX_MESSAGE
    characters (the file, what was found, what was expected)."""

    def __init__(self, path, problem: str, hint: str = ""):
        shown = str(path) if len(str(path)) <= 120 else "\u2026" + str(path)[-119:]
        msg = f"{shown}: {problem}"
        if hint:
            msg += f" ({hint})"
        super().__init__(one_line(msg))
        self.path = str(path)


class NonFiniteError(HybridMoeError):
    """The model computed NaN or inf (corrupt weights, or an overflow): generation stops with this line."""


class PlacementError(HybridMoeError):
    """A placement rule is invalid or the placement does not fit."""
