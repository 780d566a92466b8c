"""Number formats of accelerators, bit-exact, as fake quantization (`quantize`) and as bit codes
(`encode` / `decode`), on any torch tensor, vectorized.

`quantize(x, fmt)` returns float32 values that are exactly representable in `fmt` (with its scales),
so a model computes "as the chip would store it" in plain float32 kernels; `decode(encode(x, fmt))`
gives the same bits. Block formats take blocks of `block_size` consecutive values along `axis`;
a last partial block is padded with zeros (as Tenstorrent's tilizer pads tiles, and as zeros
change no block maximum), and the padding is dropped again on the way out.

Sources, per format (values checked in tests/numerics/test_formats.py):
- fp16: IEEE 754 binary16. bf16: Google brain float (8-bit exponent, 7-bit mantissa).
  tf32: NVIDIA TensorFloat-32 (e8m10; also Tenstorrent's 19-bit SrcA/SrcB register format).
  fp22: e8m13, the ~14-bit-significand accumulator of Hopper FP8 tensor cores (DeepSeek-V3
  tech report, sec. 3.3.2, "limited accumulation precision").
- fp8_e4m3 / fp8_e5m2: OCP 8-bit Floating Point Specification (OFP8) v1.0: E4M3 bias 7, no inf,
  one NaN pattern (S.1111.111), max 448; E5M2 bias 15, IEEE inf/NaN, max 57344.
- fp6_e3m2 / fp6_e2m3 / fp4_e2m1 and the MX formats: OCP Microscaling Formats (MX) v1.0 (2023):
  element max normals 28, 7.5, 6; no inf/NaN; E8M0 scale (bias 127, 0xFF = NaN); MXINT8 elements
  are 8-bit two's complement with an implicit 2^-6 (here symmetric, ±127/64).
- bfp8_b / bfp4_b / bfp2_b: Tenstorrent block floating point (tt-metal
  tt_metal/impl/data_format/blockfloat_common.cpp, bfp_simd.hpp, bfloat8.cpp).
- nvfp4: NVIDIA NVFP4 (Blackwell): e2m1 elements, 16-value blocks with an E4M3 scale, and a
  per-tensor fp32 scale (torchao.prototype.mx_formats.nvfp4_tensor).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from firstlight.numerics import blocks
from firstlight.numerics.errors import NumericsError
from firstlight.numerics.scalar import Noise, check_rounding, float_codes, float_decode, round_float

KINDS = ("float", "int", "block_float", "mx", "nvfp4")
SCALAR_KINDS = ("float", "int")


@dataclass(frozen=True)
class Format:
    """One number format. For block formats the bit fields describe the element."""

    name: str
    kind: str  # "float" | "int" (MX int8 element) | "block_float" (TT bfp*_b) | "mx" | "nvfp4"
    exp_bits: int
    man_bits: int
    block_size: int | None
    bits_per_value: float  # element bits + the amortized shared scale (bfp8_b: 8 + 8/16 = 8.5)
    bias: int = 0
    max_normal: float = 0.0  # largest finite element magnitude (before any shared scale)
    has_inf: bool = False
    has_nan: bool = False
    saturating: bool = True  # overflow clamps to ±max_normal (else ±inf)
    element: str | None = None  # block formats: the element format's name in FORMATS
    scale: str | None = None  # block formats: "exp8" (TT shared exponent) | "e8m0" | "fp8_e4m3"
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise NumericsError(f"format {self.name!r}: unknown kind {self.kind!r}, expected one of {KINDS}")
        if self.kind == "float" and not (self.has_inf or self.saturating):
            raise NumericsError(f"format {self.name!r}: a format without infinity must saturate")

    @property
    def emin(self) -> int:
        """Unbiased exponent of the smallest normal value."""
        return 1 - self.bias

    @property
    def emax(self) -> int:
        """floor(log2(max_normal)): the OCP MX `emax_elem` of an element format."""
        return math.floor(math.log2(self.max_normal))

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (self.emin - self.man_bits)

    @property
    def code_bits(self) -> int:
        """Width of one element code, sign included."""
        return 1 + self.exp_bits + self.man_bits if self.kind != "int" else 8


def _float(name: str, e: int, m: int, bias: int, *, inf: bool, nan: bool, sat: bool, source: str) -> Format:
    if inf:  # IEEE: the top exponent is reserved for inf / NaN
        max_normal = (2 - 2.0**-m) * 2.0 ** (2**e - 2 - bias)
    elif nan:  # OCP "fn": only S.1..1.1..1 is NaN, the rest of the top binade is finite
        max_normal = (2 - 2.0 ** (1 - m)) * 2.0 ** (2**e - 1 - bias)
    else:
        max_normal = (2 - 2.0**-m) * 2.0 ** (2**e - 1 - bias)
    return Format(name, "float", e, m, None, float(1 + e + m), bias, max_normal, inf, nan or inf, sat, source=source)


_OFP8 = "OCP 8-bit Floating Point Specification (OFP8) v1.0"
_MX = "OCP Microscaling Formats (MX) Specification v1.0"
_TT = "tt-metal tt_metal/impl/data_format/blockfloat_common.cpp + bfp_simd.hpp (host bfp pack/unpack)"

_SCALAR = [
    _float("fp32", 8, 23, 127, inf=True, nan=True, sat=False, source="IEEE 754 binary32"),
    _float("tf32", 8, 10, 127, inf=True, nan=True, sat=False, source="NVIDIA TF32; Tenstorrent SrcA/SrcB 19-bit"),
    _float("fp22", 8, 13, 127, inf=True, nan=True, sat=False, source="DeepSeek-V3 report sec. 3.3.2 (FP8 GEMM accumulator)"),
    _float("bf16", 8, 7, 127, inf=True, nan=True, sat=False, source="bfloat16"),
    _float("fp16", 5, 10, 15, inf=True, nan=True, sat=False, source="IEEE 754 binary16"),
    _float("fp8_e4m3", 4, 3, 7, inf=False, nan=True, sat=True, source=_OFP8 + " (saturating conversion)"),
    _float("fp8_e5m2", 5, 2, 15, inf=True, nan=True, sat=False, source=_OFP8),
    # AMD CDNA3 / Graphcore "fnuz": bias one higher, no infinity, no negative zero (its code 0x80 is the
    # one NaN), so every other pattern is finite: max 240 (E4M3) / 57344 (E5M2). Values as OFP8 otherwise.
    _float("fp8_e4m3fnuz", 4, 3, 8, inf=False, nan=False, sat=True,
           source="AMD CDNA 3 ISA reference, FP8 (E4M3 FNUZ); onnx float8e4m3fnuz"),
    _float("fp8_e5m2fnuz", 5, 2, 16, inf=False, nan=False, sat=True,
           source="AMD CDNA 3 ISA reference, BF8 (E5M2 FNUZ); onnx float8e5m2fnuz"),
    _float("fp6_e3m2", 3, 2, 3, inf=False, nan=False, sat=True, source=_MX),
    _float("fp6_e2m3", 2, 3, 1, inf=False, nan=False, sat=True, source=_MX),
    _float("fp4_e2m1", 2, 1, 1, inf=False, nan=False, sat=True, source=_MX),
    Format("int8_mx", "int", 0, 6, None, 8.0, 0, 127 / 64, source=_MX + " (MXINT8 element, 2^-6 implicit)"),
]


def _bfp(name: str, m: int) -> Format:
    return Format(name, "block_float", 0, m, 16, 1 + m + 8 / 16, 0, (2**m - 1) / 2 ** (m - 1), scale="exp8", source=_TT)


def _mx(name: str, element: str) -> Format:
    el = next(f for f in _SCALAR if f.name == element)
    return Format(
        name, "mx", el.exp_bits, el.man_bits, 32, el.code_bits + 8 / 32, el.bias, el.max_normal,
        element=element, scale="e8m0", source=_MX,
    )  # fmt: skip


_BLOCK = [
    _bfp("bfp8_b", 7),
    _bfp("bfp4_b", 3),
    _bfp("bfp2_b", 1),
    _mx("mxfp8_e4m3", "fp8_e4m3"),
    _mx("mxfp8_e5m2", "fp8_e5m2"),
    _mx("mxfp6_e3m2", "fp6_e3m2"),
    _mx("mxfp6_e2m3", "fp6_e2m3"),
    _mx("mxfp4", "fp4_e2m1"),
    _mx("mxint8", "int8_mx"),
    Format(
        "nvfp4", "nvfp4", 2, 1, 16, 4 + 8 / 16, 1, 6.0, element="fp4_e2m1", scale="fp8_e4m3",
        source="NVIDIA NVFP4; torchao.prototype.mx_formats.nvfp4_tensor.nvfp4_quantize",
    ),  # fmt: skip
]

FORMATS: dict[str, Format] = {f.name: f for f in _SCALAR + _BLOCK}
SCALINGS_HELP = "None, 'tensor' or 'block:N'"
CHUNK_ELEMENTS = 1 << 16  # values fake-quantized per step (256 KiB of float32)


def get_format(name: str | Format) -> Format:
    if isinstance(name, Format):
        return name
    try:
        return FORMATS[name]
    except KeyError:
        raise NumericsError(f"unknown number format {name!r}: expected one of {', '.join(FORMATS)}") from None


@dataclass(frozen=True)
class Encoded:
    """Bit codes of a tensor in a format. Block formats (and block scaling) keep the block layout:
    `codes` is [..., num_blocks, block_size] with the block axis moved last and zero-padded."""

    format: Format
    codes: torch.Tensor  # element codes: uint8 when they fit in 8 bits, else int32
    scales: torch.Tensor | None  # bfp: shared exponent (uint8); mx: E8M0 (uint8); nvfp4: E4M3 codes (uint8);
    #                              scalar formats with scaling: float32 scale(s)
    tensor_scale: torch.Tensor | None  # nvfp4: the per-tensor fp32 scale (0-d)
    shape: tuple[int, ...]  # the original tensor's shape
    axis: int  # the block axis, non-negative
    scaling: str | None = None


def _parse_scaling(scaling: str | None, fmt: Format) -> int | None:
    """None -> None; 'tensor' -> 0; 'block:N' -> N."""
    if scaling is None:
        return None
    if fmt.kind not in SCALAR_KINDS:
        raise NumericsError(f"scaling={scaling!r} applies to scalar formats; {fmt.name} brings its own block scales")
    if scaling == "tensor":
        return 0
    if scaling.startswith("block:") and scaling[6:].isdigit() and int(scaling[6:]) > 0:
        return int(scaling[6:])
    raise NumericsError(f"unknown scaling {scaling!r}: expected {SCALINGS_HELP}")


def _to_blocks(x: torch.Tensor, axis: int, block: int) -> tuple[torch.Tensor, int]:
    x = x.movedim(axis, -1)
    n = x.shape[-1]
    pad = (-n) % block
    if pad:
        x = F.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], -1, block).contiguous(), n


def _from_blocks(xb: torch.Tensor, n: int, axis: int) -> torch.Tensor:
    return xb.flatten(-2)[..., :n].movedim(-1, axis)


def _norm_axis(x: torch.Tensor, axis: int) -> int:
    if x.dim() == 0:
        raise NumericsError("block formats and block scaling need a tensor with at least one dimension")
    if not -x.dim() <= axis < x.dim():
        raise NumericsError(f"axis {axis} out of range for a tensor of shape {tuple(x.shape)}")
    return axis % x.dim()


def _round_scalar(x: torch.Tensor, f: Format, rounding: str, noise: Noise | None) -> torch.Tensor:
    if f.kind == "int":
        return blocks.mx_elements(x, f, rounding, noise)
    return round_float(
        x, exp_bits=f.exp_bits, man_bits=f.man_bits, bias=f.bias, max_normal=f.max_normal,
        has_inf=f.has_inf, saturating=f.saturating, rounding=rounding, noise=noise,
    )  # fmt: skip


def _amax_scale(xb: torch.Tensor, f: Format, per_block: bool) -> torch.Tensor:
    """fp32 scale amax / max_normal (per tensor, or per row of xb); 1 where amax is 0 or not finite."""
    amax = blocks.abs_amax_bits(xb).view(torch.float32) if per_block else xb.abs().amax()
    s = amax / f.max_normal
    return torch.where((s > 0) & torch.isfinite(s), s, torch.ones_like(s))


def _noise(rounding: str, generator: torch.Generator | None) -> Noise | None:
    return Noise.draw(generator) if rounding == "stochastic" else None


def _at(noise: Noise | None, offset: int) -> Noise | None:
    return None if noise is None else noise.at(offset)


def _fake_rows(
    rows: torch.Tensor, f: Format, rounding: str, noise: Noise | None, block_scaled: bool, ts: torch.Tensor | None
) -> torch.Tensor:
    """Fake-quantize rows [r, C] (each row one block, or a flat run of scalar values)."""
    if f.kind in SCALAR_KINDS:
        if not block_scaled:
            return _round_scalar(rows, f, rounding, noise)
        s = _amax_scale(rows, f, True)
        return _round_scalar(rows / s, f, rounding, noise) * s
    if f.kind == "block_float":
        return blocks.bfp_fake(rows, f.man_bits, rounding, noise)
    elem = FORMATS[f.element]
    if f.kind == "mx":
        return blocks.mx_dequantize(*blocks.mx_quantize(rows, elem, rounding, noise))
    p, sb = blocks.nvfp4_quantize(rows, ts, elem, FORMATS[f.scale], rounding, noise)
    return blocks.nvfp4_dequantize(p, sb, ts)


def _map_rows(fn, x2d: torch.Tensor) -> torch.Tensor:
    """fn(rows, flat_offset) over row chunks of ~CHUNK_ELEMENTS values: temporaries stay small (no
    page faults from large fresh allocations) and in cache. Results do not depend on the chunking."""
    num_rows, width = x2d.shape
    step = max(1, CHUNK_ELEMENTS // max(width, 1))
    if num_rows <= step:
        return fn(x2d, 0)
    out = torch.empty_like(x2d)
    for start in range(0, num_rows, step):
        out[start : start + step] = fn(x2d[start : start + step], start * width)
    return out


def _quantize_parts(
    x: torch.Tensor, f: Format, axis: int, rounding: str, noise: Noise | None, scaling: str | None
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, int, int]:
    """For `encode`: (values in the format's own units, blocked if blocked; scales; tensor scale; n; axis)."""
    x = x.to(torch.float32)
    if f.kind in SCALAR_KINDS:
        block = _parse_scaling(scaling, f)
        if block is None:
            return _round_scalar(x.contiguous(), f, rounding, noise), None, None, 0, axis
        if block == 0:
            s = _amax_scale(x, f, False)
            return _round_scalar((x / s).contiguous(), f, rounding, noise), s, None, 0, axis
        axis = _norm_axis(x, axis)
        xb, n = _to_blocks(x, axis, block)
        s = _amax_scale(xb, f, True)
        return _round_scalar(xb / s, f, rounding, noise), s, None, n, axis
    if scaling is not None:
        _parse_scaling(scaling, f)
    axis = _norm_axis(x, axis)
    xb, n = _to_blocks(x, axis, f.block_size)
    if f.kind == "block_float":
        codes, shared = blocks.bfp_encode(xb, f.man_bits, rounding, noise)
        return codes, shared, None, n, axis
    elem = FORMATS[f.element]
    if f.kind == "mx":
        p, biased = blocks.mx_quantize(xb, elem, rounding, noise)
        return p, biased, None, n, axis
    ts = blocks.nvfp4_tensor_scale(x)
    p, sb = blocks.nvfp4_quantize(xb, ts, elem, FORMATS[f.scale], rounding, noise)
    return p, sb, ts, n, axis


def quantize(
    x: torch.Tensor,
    fmt: str | Format,
    *,
    axis: int = -1,
    rounding: str = "rne",
    generator: torch.Generator | None = None,
    scaling: str | None = None,
) -> torch.Tensor:
    """Fake quantization: float32 tensor of x's shape whose values are exactly representable in `fmt`.

    rounding: "rne" | "stochastic" (needs `generator`) | "truncate" (toward zero). scaling, for scalar
    formats only: None (values taken as they are; overflow saturates or goes to inf as the format
    defines), "tensor" (x / s with s = amax / max_normal, rounded, times s), "block:N" (one such fp32
    scale per N consecutive values along `axis`, e.g. DeepSeek-V3's 1x128 activation tiles).
    """
    f = get_format(fmt)
    check_rounding(rounding, generator)
    if f.name == "fp32" and scaling is None:
        return x.to(torch.float32)
    noise = _noise(rounding, generator)
    x = x.to(torch.float32)
    if f.kind in SCALAR_KINDS:
        block = _parse_scaling(scaling, f)
        if not block:  # None (no scaling) or 0 (one scale for the tensor)
            s = None if block is None else _amax_scale(x, f, False)
            flat = (x if s is None else x / s).contiguous().view(-1, 1)
            out = _map_rows(lambda rows, off: _round_scalar(rows, f, rounding, _at(noise, off)), flat).view(x.shape)
            return out if s is None else out * s
    else:
        if scaling is not None:
            _parse_scaling(scaling, f)
        block = f.block_size
    axis = _norm_axis(x, axis)
    xb, n = _to_blocks(x, axis, block)
    ts = blocks.nvfp4_tensor_scale(x) if f.kind == "nvfp4" else None
    scaled = f.kind in SCALAR_KINDS
    out = _map_rows(lambda rows, off: _fake_rows(rows, f, rounding, _at(noise, off), scaled, ts), xb.view(-1, block))
    return _from_blocks(out.view(xb.shape), n, axis)


def _elem_codes(p: torch.Tensor, elem: Format) -> torch.Tensor:
    if elem.kind == "int":
        return (torch.round(p * 2**elem.man_bits).to(torch.int32) & 0xFF).to(torch.uint8)
    codes = float_codes(
        p, exp_bits=elem.exp_bits, man_bits=elem.man_bits, bias=elem.bias, has_inf=elem.has_inf, has_nan=elem.has_nan
    )
    return codes.to(torch.uint8) if elem.code_bits <= 8 else codes


def _elem_decode(codes: torch.Tensor, elem: Format) -> torch.Tensor:
    if elem.kind == "int":
        return codes.to(torch.int8).to(torch.float32) / 2**elem.man_bits
    return float_decode(
        codes, exp_bits=elem.exp_bits, man_bits=elem.man_bits, bias=elem.bias, has_inf=elem.has_inf, has_nan=elem.has_nan
    )


def encode(
    x: torch.Tensor,
    fmt: str | Format,
    *,
    axis: int = -1,
    rounding: str = "rne",
    generator: torch.Generator | None = None,
    scaling: str | None = None,
) -> Encoded:
    """The bit codes (and scales) of `quantize(x, fmt, ...)`: `decode(encode(x)) == quantize(x)` bit for bit."""
    f = get_format(fmt)
    check_rounding(rounding, generator)
    shape = tuple(x.shape)
    vals, scales, ts, _, axis = _quantize_parts(x, f, axis, rounding, _noise(rounding, generator), scaling)
    if f.kind in SCALAR_KINDS:
        return Encoded(f, _elem_codes(vals, f), scales, None, shape, axis % max(x.dim(), 1), scaling)
    if f.kind == "block_float":
        return Encoded(f, vals.to(torch.uint8), scales.squeeze(-1).to(torch.uint8), None, shape, axis)
    elem = FORMATS[f.element]
    codes = _elem_codes(torch.where(torch.isnan(vals), 0.0, vals), elem)  # a NaN block lives in its scale
    if f.kind == "mx":
        return Encoded(f, codes, scales.squeeze(-1).to(torch.uint8), None, shape, axis)
    sb = _elem_codes(scales.squeeze(-1), FORMATS[f.scale])
    return Encoded(f, codes, sb, ts, shape, axis)


def decode(enc: Encoded) -> torch.Tensor:
    """float32 values of encoded codes, in the original shape."""
    f = enc.format
    n = enc.shape[enc.axis] if enc.shape else 0
    if f.kind in SCALAR_KINDS:
        vals = _elem_decode(enc.codes, f)
        if enc.scales is None:
            return vals
        if enc.scales.dim() == 0:
            return vals * enc.scales
        return _from_blocks(vals * enc.scales, n, enc.axis)
    if f.kind == "block_float":
        out = blocks.bfp_decode(enc.codes, enc.scales.unsqueeze(-1), f.man_bits)
    elif f.kind == "mx":
        biased = enc.scales.to(torch.int32).unsqueeze(-1)
        out = blocks.mx_dequantize(_elem_decode(enc.codes, FORMATS[f.element]), biased)
    else:
        sb = _elem_decode(enc.scales, FORMATS[f.scale]).unsqueeze(-1)
        out = blocks.nvfp4_dequantize(_elem_decode(enc.codes, FORMATS[f.element]), sb, enc.tensor_scale)
    return _from_blocks(out, n, enc.axis)
