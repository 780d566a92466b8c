"""Errors a user can act on.

Every error raised for bad input is a `FirstlightError`: its message names the input, what was
expected and what to do. The CLI prints it on one line and exits non-zero, with no traceback.
"""


class FirstlightError(Exception):
    """Bad input or an unmet precondition, explained for the user."""

    exit_code: int = 1


class ModelLoadError(FirstlightError):
    """A checkpoint, GGUF file or config could not be loaded."""


class NoSpaceError(ModelLoadError):
    """Not enough free disk space to download or convert a model."""


class UnknownModelError(FirstlightError):
    """A model name or architecture that firstlight does not know."""
