"""User-facing errors: one line that says what was wrong and what to do."""


def warn_fallback(what: str, err: Exception, instead: str) -> None:
    """One stderr line when a fast path fails at run time and a slower, correct one takes over."""
    import sys
    first = str(err).splitlines()[0] if str(err) else ""
    print(f"warning: {what} failed ({type(err).__name__}: {first}); {instead}", file=sys.stderr)


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
