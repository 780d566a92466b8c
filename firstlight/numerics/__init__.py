"""Accelerator numerics, emulated in vectorized torch: number formats (bit-exact), matmuls with a
chip's operand formats, multiplier fidelity and accumulator, and approximate transcendentals.

The emulated-chip target (`firstlight.targets.emulated`) computes with these; docs/EMULATION.md
("Formats") lists each format's source and where maintained libraries disagree.
"""

from firstlight.numerics.arithmetic import FIDELITIES, MatmulNumerics, PreparedWeight, matmul, prepare_weight
from firstlight.numerics.errors import NumericsError
from firstlight.numerics.formats import FORMATS, Encoded, Format, decode, encode, get_format, quantize
from firstlight.numerics.transcendentals import APPROX, approx

__all__ = [
    "APPROX",
    "FIDELITIES",
    "FORMATS",
    "Encoded",
    "Format",
    "MatmulNumerics",
    "NumericsError",
    "PreparedWeight",
    "approx",
    "decode",
    "encode",
    "get_format",
    "matmul",
    "prepare_weight",
    "quantize",
]
