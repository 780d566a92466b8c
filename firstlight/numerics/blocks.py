"""Block formats: values in blocks along one axis share a scale. All functions take float32 blocks
`xb` of shape [..., num_blocks, block_size] and work on the whole tensor at once (int32 bit ops).

Tenstorrent bfp*_b (BFP8_B / BFP4_B / BFP2_B): 16 values (one row of a 16x16 face) share an 8-bit
exponent, the largest float32 exponent field in the row; each value keeps a sign and a w-bit
magnitude (w = 7 / 3 / 1) that is its 24-bit significand (hidden bit included) shifted right by
(shared - own exponent), then rounded to w bits. This follows tt-metal's host packer
(tt_metal/impl/data_format/bfp_simd.hpp `row_scalar`, and `convert_u32_to_bfp` in
blockfloat_common.cpp): inputs with exponent field 0 (zero, fp32 subnormals) become 0; the shift
drops bits before rounding (so a value just above a tie, shifted, can round to even); ties to
even; a magnitude that rounds up past 2^w - 1 saturates there (the shared exponent is not
bumped); a zero magnitude loses its sign. The decode follows `unpack_bfp8_tiles_into_float_vec`
(tt_metal/impl/data_format/bfloat8.cpp): renormalize to a float32 with exponent
shared - shift_count; flush to zero when that exponent is negative; exponent 0 gives the
float32 denormal bit pattern the unpacker writes. A block holding inf/NaN has shared exponent
255: its largest values decode to inf/NaN and the rest to values near 2^127 or zero.

OCP Microscaling (MX v1.0, sec. 6.3): 32 values share an E8M0 scale X = 2^(floor(log2(amax)) -
emax_elem), clamped to the E8M0 range [2^-127, 2^127]; each element is V_i / X rounded to the
element format (ties to even) and clamped to its max normal. A block whose amax is NaN or inf gets
the NaN scale (0xFF) and decodes to all NaN (spec sec. 5.3: X = NaN makes every value NaN).

NVFP4 (NVIDIA Blackwell; as torchao's `nvfp4_quantize` implements the two-level recipe): a
per-tensor fp32 scale ts = amax(tensor) / (448 * 6); per 16-value block an E4M3 scale
sb = e4m3(clamp(amax(block) / 6 / ts, 2^-6, 448)); elements e2m1(clamp(x * ((1 / ts) / sb), ±6));
value = element * (ts * sb).
"""

from __future__ import annotations

import torch

from firstlight.numerics.scalar import (
    F32_INF_BITS,
    SIGN_BIT,
    Noise,
    lt_mask,
    random_bits,
    round_float,
    round_to_integer,
    select,
)

E8M0_NAN = 255
E4M3_MIN_NORMAL = 2.0**-6
E4M3_MAX = 448.0
E2M1_MAX = 6.0


def _i32(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def _f32(bits: torch.Tensor) -> torch.Tensor:
    return bits.contiguous().view(torch.float32)


# --- Tenstorrent bfp*_b -------------------------------------------------------------------------


def bfp_encode(
    xb: torch.Tensor, man_bits: int, rounding: str, noise: Noise | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (codes int32 [..., nb, 16]: sign << w | magnitude, shared exponent int32 [..., nb, 1])."""
    bits = _i32(xb)
    exp = (bits >> 23) & 0xFF
    shared = exp.amax(dim=-1, keepdim=True)
    significand = (bits & 0x7FFFFF) | 0x800000
    significand = significand >> torch.clamp(shared - exp, max=31)
    shift = 24 - man_bits
    if rounding == "rne":
        mag = (significand + (((significand >> shift) & 1) + ((1 << (shift - 1)) - 1))) >> shift
    elif rounding == "truncate":
        mag = significand >> shift
    else:
        mag = (significand + (random_bits(significand.shape, noise, xb.device) >> (24 - shift))) >> shift
    mag = torch.clamp(mag, max=(1 << man_bits) - 1) & lt_mask(0, exp)  # exponent field 0 -> 0
    sign = (bits >> 31) & 1
    codes = mag | ((sign << man_bits) & lt_mask(0, mag))  # a zero magnitude carries no sign
    return codes, shared


def bfp_decode(codes: torch.Tensor, shared: torch.Tensor, man_bits: int) -> torch.Tensor:
    codes = codes.to(torch.int32)
    shared = shared.to(torch.int32)
    mag = codes & ((1 << man_bits) - 1)
    sign = (codes >> man_bits) & 1
    top = (_i32(mag.to(torch.float32)) >> 23) - 127  # floor(log2(mag)); -127 for mag == 0
    shift_count = (man_bits - 1) - top
    exp = shared - shift_count
    man = (mag << torch.clamp(shift_count + 1, 0, 31)) & ((1 << man_bits) - 1)
    bits = (sign << 31) | (exp << 23) | (man << (23 - man_bits))
    return _f32(bits & ~(lt_mask(mag, 1) | lt_mask(exp, 0)))  # zero magnitude, or exponent < 0: flush


def bfp_fake(xb: torch.Tensor, man_bits: int, rounding: str, noise: Noise | None) -> torch.Tensor:
    """bfp_decode(bfp_encode(xb)) in about half the ops: a code from the packer always decodes to
    magnitude * 2^(shared - 127 - (w - 1)) (its exponent is its input's, >= 1); blocks holding inf /
    NaN (shared exponent 255) take the exact unpacker path."""
    codes, shared = bfp_encode(xb, man_bits, rounding, noise)
    if bool((shared == 255).any()):
        return bfp_decode(codes, shared, man_bits)
    mag = codes & ((1 << man_bits) - 1)
    value = mag.to(torch.float32) * 2.0 ** -(man_bits - 1) * _f32(shared << 23)
    return _f32(_i32(value) | ((codes << (31 - man_bits)) & SIGN_BIT))


# --- OCP MX ---------------------------------------------------------------------------------------


def abs_amax_bits(xb: torch.Tensor) -> torch.Tensor:
    """int32 bits of max |x| over the last dim (a NaN anywhere gives NaN bits): an integer max of the
    magnitude bits, as float32 order is integer order for non-negative floats."""
    return (_i32(xb) & 0x7FFFFFFF).amax(dim=-1, keepdim=True)


def mx_scale(xb: torch.Tensor, emax_elem: int) -> torch.Tensor:
    """Biased E8M0 shared exponent per block, int32 [..., nb, 1]: floor(log2(amax)) - emax_elem + 127,
    clamped to [0, 254]; 255 (NaN) for a block with a NaN or an infinity."""
    amax = abs_amax_bits(xb)
    biased = torch.clamp((amax >> 23) - emax_elem, min=0)  # (field - 127 - emax) + 127, floor at 2^-127
    return biased | (~lt_mask(amax, F32_INF_BITS) & E8M0_NAN)


def e8m0_value(biased: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(X, 1/X) as float32 for biased E8M0 exponents; X is NaN for 255 (and 1/X then 1.0)."""
    nan = lt_mask(254, biased)
    b = select(nan, 127, biased)
    x = (b << 23) | (lt_mask(b, 1) & (1 << 22)) | (nan & 0x7FC00000)  # 2^-127 is a float32 subnormal
    return _f32(x), _f32((254 - b) << 23)  # 1/X is always a normal float32


def mx_elements(v: torch.Tensor, elem, rounding: str, noise: Noise | None) -> torch.Tensor:
    """Scaled values V_i / X -> element-format values (saturating), float32."""
    if elem.kind == "int":
        step = float(2**elem.man_bits)
        limit = float((1 << (elem.man_bits + 1)) - 1)  # 127 for int8 with 6 fraction bits: symmetric
        return torch.clamp(round_to_integer(v * step, rounding, noise), -limit, limit) / step + 0.0  # no -0
    return round_float(
        v,
        exp_bits=elem.exp_bits,
        man_bits=elem.man_bits,
        bias=elem.bias,
        max_normal=elem.max_normal,
        has_inf=elem.has_inf,
        saturating=True,
        rounding=rounding,
        noise=noise,
    )


def mx_quantize(
    xb: torch.Tensor, elem, rounding: str, noise: Noise | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (element values float32 [..., nb, 32], biased E8M0 int32 [..., nb, 1])."""
    biased = mx_scale(xb, elem.emax)
    _, inv = e8m0_value(biased)
    p = mx_elements(xb * inv, elem, rounding, noise)
    return p, biased


def mx_dequantize(p: torch.Tensor, biased: torch.Tensor) -> torch.Tensor:
    x, _ = e8m0_value(biased)
    return p * x  # X is NaN for a NaN scale


# --- NVFP4 ----------------------------------------------------------------------------------------


def nvfp4_tensor_scale(x: torch.Tensor) -> torch.Tensor:
    """fp32 per-tensor scale amax / (448 * 6); 1.0 for an all-zero or non-finite tensor."""
    amax = x.abs().amax().float() if x.numel() else torch.zeros((), device=x.device)
    ts = amax / (E4M3_MAX * E2M1_MAX)
    return torch.where((ts > 0) & torch.isfinite(ts), ts, torch.ones_like(ts))


def nvfp4_quantize(
    xb: torch.Tensor, ts: torch.Tensor, elem, scale_fmt, rounding: str, noise: Noise | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (e2m1 element values float32 [..., nb, 16], E4M3 block scales float32 [..., nb, 1])."""
    amax = _f32(abs_amax_bits(xb))
    sb = torch.clamp((amax / E2M1_MAX) / ts, min=E4M3_MIN_NORMAL, max=E4M3_MAX)
    sb = round_float(
        sb,
        exp_bits=scale_fmt.exp_bits,
        man_bits=scale_fmt.man_bits,
        bias=scale_fmt.bias,
        max_normal=scale_fmt.max_normal,
        has_inf=False,
        saturating=True,
    )  # the scale is always rounded to nearest, whatever the element rounding
    v = torch.clamp(xb * ((1.0 / ts) / sb), -E2M1_MAX, E2M1_MAX)
    p = mx_elements(v, elem, rounding, noise)
    return p, sb


def nvfp4_dequantize(p: torch.Tensor, sb: torch.Tensor, ts: torch.Tensor) -> torch.Tensor:
    return p * (ts * sb)

