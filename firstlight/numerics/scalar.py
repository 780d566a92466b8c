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
(uniform draws at 2^-24 resolution, summed in float64 so the sum itself is exact).
"""

from __future__ import annotations

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
    generator: torch.Generator | None = None,
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
            r = mag + torch.randint(0, 1 << shift, x.shape, generator=generator, dtype=torch.int32, device=x.device)
        r = r & ~low
        r = torch.where(mag > F32_INF_BITS, mag, r)  # NaN stays NaN (its carry could reach the sign bit)
        if saturating:
            r = torch.clamp(_f32(r), max=max_normal).view(torch.int32)
        return _f32(r | sign)
    # Narrow exponent: quantum from the exponent field, clamped to the subnormal quantum.
    fmin = (1 - bias) + 127  # float32 exponent field of 2^emin
    if fmin - man_bits < 1:
        raise NumericsError(f"format e{exp_bits}m{man_bits} bias {bias}: quantum below float32's normal range")
    field = torch.clamp(mag >> 23, fmin, 254)
    qfield = field - man_bits
    q = _f32(qfield << 23)
    inv_q = _f32((254 - qfield) << 23)
    y = _f32(mag) * inv_q
    if rounding == "rne":
        y = torch.round(y)
    elif rounding == "truncate":
        y = torch.trunc(y)
    else:
        u = torch.rand(x.shape, generator=generator, dtype=torch.float32, device=x.device)
        y = torch.floor(y.double() + u.double()).float()
    out = y * q
    # saturating: clamp (also maps +inf to max_normal; NaN passes through); else IEEE overflow to inf
    out = torch.clamp(out, max=max_normal) if saturating else torch.where(out > max_normal, torch.inf, out)
    return _f32(_i32(out) | sign)


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
