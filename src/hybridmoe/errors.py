"""User-facing errors: one line that says what was wrong and what to do."""


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
