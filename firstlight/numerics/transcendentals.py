"""Transcendental functions as accelerator vector units compute them: bit tricks, low-degree
polynomials, lookup tables and Newton iterations, in vectorized torch on float32.

`APPROX[op][impl]` is a float32 -> float32 function; `approx(op, impl)` looks one up. Every op has
"exact" (torch's float32 function). Each approximation's docstring names its source and its
measured max relative error (absolute where the function crosses zero) over the stated range; the
figures are asserted in tests/numerics/test_transcendentals.py. The Tenstorrent ones follow the
SFPU kernels of tt-metal / tt-llk (`ckernel_sfpu_exp.h`, `ckernel_sfpu_recip.h`,
`ckernel_sfpu_gelu.h`, Wormhole B0), as we read them.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from firstlight.numerics.errors import NumericsError
from firstlight.numerics.scalar import fast_where, lt_mask, select

Fn = Callable[[torch.Tensor], torch.Tensor]
LN2 = math.log(2.0)


def _f32(bits: torch.Tensor) -> torch.Tensor:
    return bits.view(torch.float32)


def _i32(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def _float(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32)


# --- exp ------------------------------------------------------------------------------------------


def exp_tt_approx(x: torch.Tensor) -> torch.Tensor:
    """Tenstorrent SFPU exp, approximation mode (`_calculate_exponential_approx_`): t = x / ln2 is
    turned into fixed point by adding 192.0 (p_exp::C23_73, 0x4340 bf16), the bias is added as an
    integer and the bits are shifted into the exponent field, so the result is
    2^floor(t) * (1 + frac(t)) with frac(t) to 16 bits: linear interpolation between powers of two.
    Saturates: x >= 89 -> inf, x < -42 -> 0. Max rel error 6.1% on [-42, 44] (never below exp(x)).
    For 44 < x < 89, x / ln2 + 192 leaves [128, 256) and the fixed-point read is wrong (our reading
    of the kernel; softmax inputs are <= 0)."""
    x = _float(x)
    t = x * 1.442695 + 192.0  # float32 add: t's fraction kept to 2^-16 (ulp of [128, 256))
    fixed = _i32(t) - 0x43400000 + (127 << 16)  # t - 192 in 16.16 fixed point, plus the exponent bias
    out = fast_where(x >= 89, math.inf, _f32(fixed << 7))
    return fast_where(x < -42, 0.0, out)


def exp_schraudolph(x: torch.Tensor) -> torch.Tensor:
    """Tenstorrent SFPU exp, fast approximation mode (`_init_exponential_<FAST_APPROX>`:
    SFPLOADMACRO sequence): Schraudolph's bit trick (Neural Computation 11(4), 1999). One MAD
    i = A/2 * x + (B - C)/2 with A = 369.329925537109375 (256 / ln2), B - C = 32500.818359375,
    rounded to an integer by the 1.5 * 2^24 magic constant, is the bf16 bit pattern of exp(x);
    the input is first clamped at -86.6 (SFPSWAP). No overflow check: x > ~88.7 wraps.
    Max rel error 3.3% on [-86, 88]; results are bf16 values."""
    x = torch.clamp(_float(x), min=-86.6)
    k = torch.round((x * 369.329925537109375 + 32500.818359375) * 0.5).to(torch.int32)
    return _f32((k & 0xFFFF) << 16)


def _exp_poly_squaring(a: torch.Tensor) -> torch.Tensor:
    """tt `_sfpu_exp_` for a >= 0: a >= 1 is scaled into [0.5, 1) by setting its exponent to -1,
    exp(v) ~ 1 + v (0.863281 + 0.8373 v), then squared (exponent + 1) times (at most 8)."""
    bits = _i32(a)
    e = ((bits >> 23) & 0xFF) - 127
    big = ~lt_mask(e, 0)  # -1 where |x| >= 1
    v = _f32(select(big, (bits & ~(0xFF << 23)) | (126 << 23), bits))
    val = v * (v * 0.8373 + 0.86328125) + 1.0
    squarings = torch.clamp(e + 1, 0, 8) & big
    for s in range(8):
        val = _f32(select(lt_mask(s, squarings), _i32(val * val), _i32(val)))
    return val


def exp_tt_accurate(x: torch.Tensor) -> torch.Tensor:
    """Tenstorrent SFPU exp, accurate mode (`_calculate_exponential_body_<false>` / `_sfpu_exp_`):
    a degree-2 polynomial on [0.5, 1) and repeated squaring for |x| >= 1; negative inputs take the
    reciprocal (`_sfpu_reciprocal_<2>`: two Newton steps). Squaring doubles the polynomial's error
    each time: max rel error 1.3% on [-1, 1], 3.8% on [-4, 4], 83% on [-80, 80]."""
    x = _float(x)
    val = _exp_poly_squaring(x.abs())
    return fast_where(x < 0, reciprocal_newton2(val), val)


def exp_range_poly3(x: torch.Tensor) -> torch.Tensor:
    """exp(x) = 2^n * p(r), n = round(x / ln2), r = x - n ln2 in [-ln2/2, ln2/2], p the degree-3
    Taylor polynomial: the textbook vector-unit exp (Cody & Waite range reduction). Max rel error
    8.0e-4 on [-80, 80]."""
    x = _float(x)
    n = torch.clamp(torch.round(x * (1 / LN2)), -127, 128)
    r = x - n * LN2
    p = 1.0 + r * (1.0 + r * (0.5 + r * (1 / 6)))
    return p * _f32((n.to(torch.int32) + 127) << 23)  # 2^n from its bits: inf above, 0 (flush) below


# --- reciprocal, rsqrt, sqrt ------------------------------------------------------------------------


def _reciprocal_seed(x: torch.Tensor) -> torch.Tensor:
    # 1/x ~ bits(0x7EF311C3 - bits(|x|)): the exponent negates, the mantissa is a linear guess
    a = x.abs()
    return torch.copysign(_f32(0x7EF311C3 - _i32(a)), x)


def _newton_reciprocal(x: torch.Tensor, steps: int) -> torch.Tensor:
    x = _float(x)
    y = _reciprocal_seed(x)
    for _ in range(steps):
        y = y * (2.0 - x * y)
    return y


def reciprocal_newton1(x: torch.Tensor) -> torch.Tensor:
    """1/x from the integer-subtraction seed (0x7EF311C3 - bits(x), max error 12%) and one
    Newton-Raphson step y(2 - xy). Max rel error 0.26% for |x| in [1e-30, 1e30]."""
    return _newton_reciprocal(x, 1)


def reciprocal_newton2(x: torch.Tensor) -> torch.Tensor:
    """As reciprocal_newton1 with two Newton steps, the count tt-metal uses (`_sfpu_reciprocal_<2>`
    in ckernel_sfpu_recip.h; its seed is a linear fit of the mantissa). Max rel error 6.6e-6."""
    return _newton_reciprocal(x, 2)


def _quake_rsqrt(x: torch.Tensor, steps: int) -> torch.Tensor:
    x = _float(x)
    y = _f32(0x5F3759DF - (_i32(x) >> 1))
    for _ in range(steps):
        y = y * (1.5 - 0.5 * x * y * y)
    return y


def rsqrt_quake1(x: torch.Tensor) -> torch.Tensor:
    """1/sqrt(x): magic constant 0x5F3759DF seed and one Newton step (Quake III; Lomont 2003).
    Max rel error 0.18% for x in [1e-30, 1e30]."""
    return _quake_rsqrt(x, 1)


def rsqrt_quake2(x: torch.Tensor) -> torch.Tensor:
    """As rsqrt_quake1 with two Newton steps. Max rel error 4.7e-6."""
    return _quake_rsqrt(x, 2)


def sqrt_via_rsqrt(x: torch.Tensor) -> torch.Tensor:
    """sqrt(x) = x * rsqrt(x), rsqrt from the magic seed and two Newton steps (the SFPU sqrt of
    tt-metal uses the same magic-constant-plus-Newton scheme). Max rel error 4.7e-6; sqrt(0) = 0."""
    x = _float(x)
    return fast_where(x == 0, 0.0, x * _quake_rsqrt(x, 2))


# --- gelu, sigmoid, silu, tanh ---------------------------------------------------------------------


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU's tanh form 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (Hendrycks & Gimpel 2016;
    torch approximate='tanh'; tt-metal `_calculate_gelu_core_`). Max abs error 4.7e-4."""
    x = _float(x)
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608 * (x + 0.044715 * x * x * x)))


# Tenstorrent GELU approximation mode (`_calculate_gelu_appx_`, gelu_init<true>): 0.5 x + L(|x|),
# L piecewise linear in |x| on [0, .5, 1, 1.5, 2, 3, inf); slopes / intercepts are the fp16
# immediates loaded into LReg0-2 / LReg4-6 (0x322B 0x37E7 0x38F3 0x38E1 0x3852 0x3800 /
# 0x86D8 0xB122 0xB479 0xB437 0xAFA4 0).
_GELU_LUT_EDGES = (0.5, 1.0, 1.5, 2.0, 3.0)
_GELU_LUT_SLOPE = (0x322B, 0x37E7, 0x38F3, 0x38E1, 0x3852, 0x3800)
_GELU_LUT_INTERCEPT = (0x86D8, 0xB122, 0xB479, 0xB437, 0xAFA4, 0x0000)


def _fp16(bits: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor([b - (1 << 16) if b >= 1 << 15 else b for b in bits], dtype=torch.int16).view(torch.float16).float()


def gelu_tt_lut(x: torch.Tensor) -> torch.Tensor:
    """Tenstorrent SFPU GELU, approximation mode: 0.5 x + a_i |x| + b_i with a 6-entry table.
    Max abs error 0.023 (near |x| = 0.25)."""
    x = _float(x)
    a = x.abs()
    slopes, intercepts = _fp16(_GELU_LUT_SLOPE).tolist(), _fp16(_GELU_LUT_INTERCEPT).tolist()
    slope = torch.full_like(a, slopes[0])
    intercept = torch.full_like(a, intercepts[0])
    for i, edge in enumerate(_GELU_LUT_EDGES):  # step functions: the table entry |x| falls in
        step = (a >= edge).to(torch.float32)
        slope += step * (slopes[i + 1] - slopes[i])
        intercept += step * (intercepts[i + 1] - intercepts[i])
    return 0.5 * x + (slope * a + intercept)


def sigmoid_exp_approx(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(-x)) with exp_tt_approx and reciprocal_newton2 (how an SFPU composes it when no
    table is used). Max abs error 0.015."""
    x = _float(x)
    return reciprocal_newton2(1.0 + exp_tt_approx(-x))


def silu_exp_approx(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid_exp_approx(x). Max rel error 5.8% (x < 0, where exp's error shows)."""
    x = _float(x)
    return x * sigmoid_exp_approx(x)


def tanh_exp_approx(x: torch.Tensor) -> torch.Tensor:
    """tanh(x) = 2 sigmoid(2x) - 1 with sigmoid_exp_approx. Max abs error 0.029."""
    x = _float(x)
    return 2.0 * sigmoid_exp_approx(2.0 * x) - 1.0


# --- log ------------------------------------------------------------------------------------------

# log2(1 + m) ~ m (c1 + m (c2 + m c3)) on m in [0, 1): near-minimax fit (iteratively reweighted least squares)
_LOG2_C = (1.42460691, -0.5892639, 0.1654352)


def log_poly3(x: torch.Tensor) -> torch.Tensor:
    """ln x = ln2 (e + log2(1 + m)) from the exponent field e and mantissa m, log2(1 + m) a cubic
    (the SFPU log's structure: exponent extraction + low-degree mantissa polynomial). Max abs
    error 5.4e-4 for x in [1e-30, 1e30] (0 -> -inf, x < 0 -> NaN)."""
    x = _float(x)
    bits = _i32(x)
    e = ((bits >> 23) & 0xFF) - 127
    m = _f32((bits & 0x7FFFFF) | (127 << 23)) - 1.0
    c1, c2, c3 = _LOG2_C
    out = (e.to(torch.float32) + m * (c1 + m * (c2 + m * c3))) * LN2
    out = fast_where(x == 0, -math.inf, out)
    return fast_where(x < 0, math.nan, out)


# --- registry -------------------------------------------------------------------------------------

APPROX: dict[str, dict[str, Fn]] = {
    "exp": {"exact": torch.exp, "tt_approx": exp_tt_approx, "schraudolph": exp_schraudolph,
            "tt_accurate": exp_tt_accurate, "range_poly3": exp_range_poly3},
    "reciprocal": {"exact": torch.reciprocal, "newton1": reciprocal_newton1, "newton2": reciprocal_newton2},
    "rsqrt": {"exact": torch.rsqrt, "quake1": rsqrt_quake1, "quake2": rsqrt_quake2},
    "sqrt": {"exact": torch.sqrt, "rsqrt_newton": sqrt_via_rsqrt},
    "gelu": {"exact": torch.nn.functional.gelu, "tanh": gelu_tanh, "tt_lut": gelu_tt_lut},
    "sigmoid": {"exact": torch.sigmoid, "exp_approx": sigmoid_exp_approx},
    "silu": {"exact": torch.nn.functional.silu, "exp_approx": silu_exp_approx},
    "tanh": {"exact": torch.tanh, "exp_approx": tanh_exp_approx},
    "log": {"exact": torch.log, "poly3": log_poly3},
}  # fmt: skip


def approx(op: str, impl: str) -> Fn:
    """The implementation `impl` of `op` (see APPROX), or a NumericsError naming the known ones."""
    if op not in APPROX:
        raise NumericsError(f"unknown transcendental op {op!r}: expected one of {', '.join(APPROX)}")
    impls = APPROX[op]
    if impl not in impls:
        raise NumericsError(f"unknown implementation {impl!r} of {op}: expected one of {', '.join(impls)}")
    return impls[impl]
