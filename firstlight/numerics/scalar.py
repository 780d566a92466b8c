"""Scalar floating-point formats as int32 bit operations on float32 (fake quantization and bit codes).

A format with `e` exponent bits, `m` mantissa bits and bias `b` has, per the IEEE 754 pattern:
smallest normal exponent emin = 1 - b, quantum (ulp) 2^(max(E, emin) - m) for a value with
unbiased exponent E, subnormals below 2^emin. Rounding to it is done in one of two ways:

- `e == 8` (bf16, tf32, fp22): the format shares float32's exponent range, so rounding is an
  integer add-and-mask on the float32 bits (the classic bf16 conversion; carries into the exponent
  field give the next binade or infinity exactly as IEEE does, fp32 subnormals included).
- narrower exponents (fp16, fp8, fp6, fp4): the quantum q = 2^(max(E, emin) - m) is built from the
  exponent field (always a normal float32), and the value is rounded as |x| / q -> integer -> * q;
  both scalings are by powers of two and exact, so the only rounding is the integer one.

Overflow follows the format: `saturating` formats clamp to ±max_normal (OCP FP8 E4M3, the MX and
NVFP4 elements; infinity too), IEEE-like ones (fp16, bf16, fp8 E5M2) overflow to ±inf. NaN stays
NaN in fake quantization (formats without a NaN encoding reject it in `float_codes`).

Rounding modes: "rne" round to nearest, ties to even (IEEE default); "truncate" toward zero;
"stochastic": round up with probability equal to the discarded fraction, from a seeded generator
(24-bit uniform draws from an integer hash of a seed and the element index, so results do
not depend on how a tensor is chunked).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from firstlight.numerics.errors import NumericsError

ROUNDINGS = ("rne", "stochastic", "truncate")
SIGN_BIT = -(2**31)  # int32 0x80000000
ABS_MASK = 0x7FFFFFFF
F32_INF_BITS = 0x7F800000


def check_rounding(rounding: str, generator: torch.Generator | None) -> None:
    if rounding not in ROUNDINGS:
        raise NumericsError(f"unknown rounding {rounding!r}: expected one of {', '.join(ROUNDINGS)}")
    if rounding == "stochastic" and generator is None:
        raise NumericsError(
            "rounding='stochastic' needs a torch.Generator (seeded) so the result is reproducible: "
            "pass generator=torch.Generator().manual_seed(SEED)"
        )


def _f32(bits: torch.Tensor) -> torch.Tensor:
    return bits.view(torch.float32)


def _i32(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32)


# torch.where / masked_fill / isfinite run ~50x slower than plain int ops on CPU in torch 2.13, so
# selections below are bit masks: `lt_mask(a, b)` is -1 (all ones) where a < b, else 0.
def lt_mask(a: torch.Tensor | int, b: torch.Tensor | int) -> torch.Tensor:
    """-1 where a < b else 0, for int32 operands whose difference does not overflow."""
    return (a - b) >> 31


def select(mask: torch.Tensor, if_set: torch.Tensor | int, if_clear: torch.Tensor | int) -> torch.Tensor:
    """Bitwise select of int32 values: `if_set` where mask is -1, `if_clear` where it is 0."""
    return (if_set & mask) | (if_clear & ~mask)


def fast_where(cond: torch.Tensor, a: torch.Tensor | float, b: torch.Tensor | float) -> torch.Tensor:
    """torch.where(cond, a, b) for float32 values, as an integer bit select (several times faster
    than torch.where on CPU). a / b: float32 tensors broadcastable to cond, or Python floats."""
    mask = -cond.to(torch.int32)

    def bits(v: torch.Tensor | float) -> torch.Tensor | int:
        if isinstance(v, torch.Tensor):
            return v.to(torch.float32).contiguous().view(torch.int32)
        return int(torch.tensor(v, dtype=torch.float32).view(torch.int32))

    return select(mask, bits(a), bits(b)).view(torch.float32)


def round_e8_(t: torch.Tensor, man_bits: int, rounding: str, noise: Noise | None) -> torch.Tensor:
    """In place: round a contiguous float32 tensor to an 8-bit-exponent format (bf16, tf32, fp22).
    Same bits as round_float, with two temporaries instead of a dozen (for accumulator loops)."""
    shift = 23 - man_bits
    if shift == 0:
        return t
    low = (1 << shift) - 1
    bits = t.view(torch.int32)
    nan = bits & ABS_MASK
    nan.neg_().add_(F32_INF_BITS).bitwise_right_shift_(31)  # -1 where NaN
    if rounding == "rne":
        inc = (bits >> shift).bitwise_and_(1).add_(low >> 1)
    elif rounding == "truncate":
        inc = None
    else:
        inc = random_bits(t.shape, noise, t.device).bitwise_right_shift_(max(0, 24 - shift))
    if inc is not None:
        bits.add_(inc.bitwise_and_(~nan))  # no increment for NaN: its carry could reach the sign
    bits.bitwise_and_(nan.bitwise_or_(~low))
    return t


@dataclass(frozen=True)
class Noise:
    """A reproducible stream of uniform random bits for stochastic rounding: element i of a tensor
    processed at flat `offset` gets hash(seed, offset + i), so a tensor rounded whole or in chunks
    gets the same bits."""

    seed: int
    offset: int = 0

    @classmethod
    def draw(cls, generator: torch.Generator) -> Noise:
        """One seed from `generator` (which advances, as it would for torch.rand)."""
        return cls(int(torch.randint(0, 2**31 - 1, (), generator=generator)))

    def at(self, offset: int) -> Noise:
        return Noise(self.seed, self.offset + offset)


def random_bits(shape: torch.Size | tuple[int, ...], noise: Noise, device: torch.device) -> torch.Tensor:
    """Uniform 24-bit integers (int32 in [0, 2^24)) of `shape`: a Weyl sequence through the `lowbias32`
    integer hash, ~8 int ops per value (torch.rand / randint cost ~15 ns per value on CPU)."""
    n = math.prod(shape)
    h = torch.arange(noise.offset % 2**31, noise.offset % 2**31 + n, dtype=torch.int64, device=device)
    h = h.to(torch.int32).view(shape) * -1640531535 + noise.seed  # 0x9E3779B1 as int32; wraps mod 2^32
    h = h ^ ((h >> 16) & 0xFFFF)
    h = h * 0x7FEB352D
    h = h ^ ((h >> 15) & 0x1FFFF)
    h = h * (0x846CA68B - 2**32)
    h = h ^ ((h >> 16) & 0xFFFF)
    return (h >> 8) & 0xFFFFFF


def round_to_integer(y: torch.Tensor, rounding: str, noise: Noise | None) -> torch.Tensor:
    """Non-negative or signed float32 y -> an integer-valued float32 per `rounding`."""
    if rounding == "rne":
        return torch.round(y)
    if rounding == "truncate":
        return torch.trunc(y)
    r = torch.floor(y)
    frac = y - r  # exact: y has at most 24 significant bits
    u = random_bits(y.shape, noise, y.device).to(torch.float32) * 2.0**-24
    return r + (u < frac).to(torch.float32)


def round_float(
    x: torch.Tensor,
    *,
    exp_bits: int,
    man_bits: int,
    bias: int,
    max_normal: float,
    has_inf: bool,
    saturating: bool,
    rounding: str = "rne",
    noise: Noise | None = None,
) -> torch.Tensor:
    """float32 x -> float32 tensor of the nearest (per `rounding`) values of the format."""
    if x.dtype != torch.float32:
        raise NumericsError(f"round_float expects float32, got {x.dtype}")
    x = x.contiguous()
    bits = _i32(x)
    sign = bits & SIGN_BIT
    mag = bits & ABS_MASK
    if exp_bits == 8:
        shift = 23 - man_bits
        if shift == 0:
            return x.clone()
        low = (1 << shift) - 1
        if rounding == "rne":
            r = mag + (((mag >> shift) & 1) + (low >> 1))
        elif rounding == "truncate":
            r = mag
        else:
            r = mag + (random_bits(x.shape, noise, x.device) >> max(0, 24 - shift))
        r = select(lt_mask(F32_INF_BITS, mag), mag, r & ~low)  # NaN stays NaN (its carry could reach the sign)
        if saturating:
            r = _i32(torch.clamp(_f32(r), max=max_normal))
        return _f32(r | sign)
    # Narrow exponent: quantum from the exponent field, clamped to the subnormal quantum.
    fmin = (1 - bias) + 127  # float32 exponent field of 2^emin
    if fmin - man_bits < 1:
        raise NumericsError(f"format e{exp_bits}m{man_bits} bias {bias}: quantum below float32's normal range")
    qfield = torch.clamp(mag >> 23, fmin, 254) - man_bits
    y = round_to_integer(_f32(mag) * _f32((254 - qfield) << 23), rounding, noise)  # |x| / q, rounded
    out = y * _f32(qfield << 23)
    if saturating:  # clamp also maps +inf to max_normal; NaN passes through
        return _f32(_i32(torch.clamp(out, max=max_normal)) | sign)
    ob = _i32(out)
    max_bits = int(torch.tensor(max_normal, dtype=torch.float32).view(torch.int32))
    overflow = lt_mask(max_bits, ob) & ~lt_mask(F32_INF_BITS, ob)  # above max_normal, not NaN
    return _f32(select(overflow, F32_INF_BITS, ob) | sign)


def float_codes(q: torch.Tensor, *, exp_bits: int, man_bits: int, bias: int, has_inf: bool, has_nan: bool) -> torch.Tensor:
    """Already-quantized float32 values -> int32 bit codes (sign | exponent | mantissa) of the format."""
    bits = _i32(q.contiguous())
    sign = (bits >> 31) & 1
    mag = bits & ABS_MASK
    width = exp_bits + man_bits
    if exp_bits == 8:
        return bits if man_bits == 23 else (bits >> (23 - man_bits)) & ((1 << (width + 1)) - 1)
    field = mag >> 23
    fmin = (1 - bias) + 127
    normal = field >= fmin
    exp_code = torch.where(normal, field - 127 + bias, 0)
    man_normal = (mag >> (23 - man_bits)) & ((1 << man_bits) - 1)
    # subnormal: |q| = man * 2^(emin - m), an exact integer after the power-of-two scaling
    sub_scale = 2.0 ** -((1 - bias) - man_bits)
    man_sub = (_f32(mag) * sub_scale).to(torch.int32)
    code = (exp_code << man_bits) | torch.where(normal, man_normal, man_sub)
    top = (1 << exp_bits) - 1
    nan = mag > F32_INF_BITS
    if has_inf:
        code = torch.where(mag == F32_INF_BITS, top << man_bits, code)
        code = torch.where(nan, (top << man_bits) | ((1 << man_bits) - 1), code)
    elif has_nan:  # "fn" style (OCP E4M3): the all-ones pattern is the only NaN
        code = torch.where(nan, (1 << width) - 1, code)
    elif bool(nan.any()):
        raise NumericsError(
            f"{int(nan.sum())} NaN value(s) cannot be encoded in a format without NaN (e{exp_bits}m{man_bits}); "
            "use quantize() (fake quantization keeps NaN) or a block format whose scale carries NaN"
        )
    return code | (sign << width)


def float_decode(code: torch.Tensor, *, exp_bits: int, man_bits: int, bias: int, has_inf: bool, has_nan: bool) -> torch.Tensor:
    """int bit codes of the format -> float32 values."""
    code = code.to(torch.int32)
    width = exp_bits + man_bits
    if exp_bits == 8:
        return _f32(code << (23 - man_bits))
    sign = ((code >> width) & 1) << 31
    exp_code = (code >> man_bits) & ((1 << exp_bits) - 1)
    man = code & ((1 << man_bits) - 1)
    normal_bits = ((exp_code - bias + 127) << 23) | (man << (23 - man_bits))
    sub = man.to(torch.float32) * 2.0 ** ((1 - bias) - man_bits)
    out = torch.where(exp_code > 0, _f32(normal_bits), sub)
    top = (1 << exp_bits) - 1
    if has_inf:
        out = torch.where(exp_code == top, torch.where(man == 0, torch.inf, torch.nan), out)
    elif has_nan:
        out = torch.where((exp_code == top) & (man == (1 << man_bits) - 1), torch.nan, out)
    return _f32(_i32(out.contiguous()) | sign)
