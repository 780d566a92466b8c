"""The one error the numerics package raises for bad input."""

from __future__ import annotations

from firstlight.errors import FirstlightError


class NumericsError(FirstlightError):
    """An unknown format, rounding mode, fidelity or approximation, or an input a format cannot take.

    Exit code 2, like a `TargetError`: the emulated chip could not be built as configured.
    """

    exit_code = 2
