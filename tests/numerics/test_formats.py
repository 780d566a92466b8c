"""Every format bit-exact: published constants, known encodings, exhaustive grids of representable
values and ties against torch / ml_dtypes casts, tt-metal's bfp rules, OCP MX and NVFP4."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from firstlight.numerics import FORMATS, Encoded, NumericsError, decode, encode, get_format, quantize


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, except that any NaN equals any NaN."""
    nan = torch.isnan(a) & torch.isnan(b)
    return bool(((bits(a) == bits(b)) | nan).all())


# --- the format table against published values -------------------------------------------------

PUBLISHED_MAX = {  # IEEE 754, OFP8 v1.0 table 1, OCP MX v1.0 tables 3-5
    "fp16": 65504.0,
    "bf16": 3.3895313892515355e38,
    "fp32": 3.4028234663852886e38,
    "fp8_e4m3": 448.0,
    "fp8_e5m2": 57344.0,
    "fp6_e3m2": 28.0,
    "fp6_e2m3": 7.5,
    "fp4_e2m1": 6.0,
    "int8_mx": 127 / 64,
}
PUBLISHED_MIN_SUBNORMAL = {
    "fp16": 2.0**-24,
    "bf16": 2.0**-133,
    "fp8_e4m3": 2.0**-9,
    "fp8_e5m2": 2.0**-16,
    "fp6_e3m2": 2.0**-4,
    "fp6_e2m3": 2.0**-3,
    "fp4_e2m1": 0.5,
}
BITS_PER_VALUE = {
    "bfp8_b": 8.5, "bfp4_b": 4.5, "bfp2_b": 2.5, "mxfp8_e4m3": 8.25, "mxfp8_e5m2": 8.25, "mxfp6_e3m2": 6.25,
    "mxfp6_e2m3": 6.25, "mxfp4": 4.25, "mxint8": 8.25, "nvfp4": 4.5, "bf16": 16, "fp8_e4m3": 8,
}  # fmt: skip
MX_EMAX = {"mxfp8_e4m3": 8, "mxfp8_e5m2": 15, "mxfp6_e3m2": 4, "mxfp6_e2m3": 2, "mxfp4": 2, "mxint8": 0}


@pytest.mark.parametrize("name", sorted(PUBLISHED_MAX))
def test_max_normal_matches_the_spec_and_is_where_quantize_saturates_or_overflows(name: str) -> None:
    f = get_format(name)
    assert f.max_normal == PUBLISHED_MAX[name]
    assert quantize(torch.tensor([PUBLISHED_MAX[name]]), name).item() == PUBLISHED_MAX[name]
    over = quantize(torch.tensor([PUBLISHED_MAX[name] * 1.5]), name).item()
    assert over == (math.inf if f.has_inf else PUBLISHED_MAX[name])


@pytest.mark.parametrize("name", sorted(PUBLISHED_MIN_SUBNORMAL))
def test_smallest_subnormal_survives_and_half_of_it_rounds_to_even_zero(name: str) -> None:
    tiny = PUBLISHED_MIN_SUBNORMAL[name]
    assert get_format(name).min_subnormal == tiny
    out = quantize(torch.tensor([tiny, tiny / 2, tiny * 0.51, -tiny / 2]), name)
    assert out.tolist() == [tiny, 0.0, tiny, -0.0]
    assert bits(out)[3].item() == -(2**31)  # negative zero keeps its sign


@pytest.mark.parametrize("name", sorted(BITS_PER_VALUE))
def test_bits_per_value_include_the_amortized_scale(name: str) -> None:
    assert FORMATS[name].bits_per_value == BITS_PER_VALUE[name]


@pytest.mark.parametrize("name", sorted(MX_EMAX))
def test_mx_emax_elem(name: str) -> None:
    f = FORMATS[name]
    assert (f.block_size, f.scale) == (32, "e8m0")
    assert FORMATS[f.element].emax == MX_EMAX[name]


# --- scalar formats: exhaustive grids against torch and ml_dtypes ---------------------------------


def representable(name: str) -> torch.Tensor:
    """Every finite value of an 8-bit-or-less format, decoded from all codes."""
    f = FORMATS[name]
    codes = torch.arange(2**f.code_bits, dtype=torch.int32)
    vals = decode(Encoded(f, codes, None, None, tuple(codes.shape), 0))
    return vals[torch.isfinite(vals)]


def probe_grid(vals: torch.Tensor) -> torch.Tensor:
    """Representable values, the midpoints between neighbours (ties), and values a hair either side."""
    v = torch.unique(vals.abs()).sort().values
    mid = (v[1:] + v[:-1]) / 2
    pts = torch.cat([v, mid, torch.nextafter(mid, torch.tensor(math.inf)), torch.nextafter(mid, torch.tensor(0.0))])
    return torch.cat([pts, -pts])


TORCH_CASTS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@pytest.mark.parametrize("name", sorted(TORCH_CASTS))
def test_scalar_rne_matches_torch_cast_on_every_tie_and_special(name: str) -> None:
    dt = TORCH_CASTS[name]
    if name.startswith("fp8"):
        x = probe_grid(representable(name))
    else:  # 16-bit: a dense random sample plus the grid around the subnormal / normal boundary
        g = torch.Generator().manual_seed(0)
        x = torch.randn(20000, generator=g) * torch.logspace(-40, 38, 20000).clamp(max=1e4)
        tiny = torch.finfo(dt).tiny
        x = torch.cat([x, probe_grid(torch.arange(0, 64) * tiny / 8), torch.tensor([65519.0, 65520.0, 1e-45])])
    x = torch.cat([x, torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 1e30, -1e30])])
    assert same_bits(quantize(x, name), x.to(dt).float())


ML_DTYPES = {"fp6_e3m2": ml_dtypes.float6_e3m2fn, "fp6_e2m3": ml_dtypes.float6_e2m3fn, "fp4_e2m1": ml_dtypes.float4_e2m1fn,
             "fp8_e4m3": ml_dtypes.float8_e4m3fn}  # fmt: skip


@pytest.mark.parametrize("name", sorted(ML_DTYPES))
def test_scalar_rne_matches_ml_dtypes_in_range(name: str) -> None:
    x = probe_grid(representable(name))
    x = torch.cat([x, torch.tensor([0.0, -0.0])])
    ref = torch.from_numpy(x.numpy().astype(ML_DTYPES[name]).astype(np.float32))
    assert same_bits(quantize(x, name), ref)
    # codes are the format's own bit patterns: ml_dtypes reads ours back to the same values
    codes = encode(x, name).codes.numpy().astype(np.uint8)
    back = torch.from_numpy(codes.view(ML_DTYPES[name]).astype(np.float32))
    assert same_bits(back, ref)


def test_ml_dtypes_disagreements_are_the_documented_ones() -> None:
    """ml_dtypes does not saturate E4M3 (overflow and inf become NaN) and maps NaN to -0 in fp4 / fp6;
    we saturate E4M3 as torch >= 2.12 and TE do, and keep NaN in fake quantization."""
    x = np.array([500.0, np.inf], np.float32)
    assert np.isnan(x.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)).all()
    assert quantize(torch.from_numpy(x), "fp8_e4m3").tolist() == [448.0, 448.0]
    assert np.array([np.nan], np.float32).astype(ml_dtypes.float4_e2m1fn).view(np.uint8)[0] == 8
    assert math.isnan(quantize(torch.tensor([math.nan]), "fp4_e2m1").item())


KNOWN_CODES = [  # (format, value, code) from the OFP8 / MX spec tables
    ("fp8_e4m3", 448.0, 0x7E), ("fp8_e4m3", math.nan, 0x7F), ("fp8_e4m3", 2.0**-9, 0x01), ("fp8_e4m3", -0.0, 0x80),
    ("fp8_e4m3", 2.0**-6, 0x08), ("fp8_e4m3", -1.0, 0xB8),
    ("fp8_e5m2", math.inf, 0x7C), ("fp8_e5m2", -math.inf, 0xFC), ("fp8_e5m2", 57344.0, 0x7B), ("fp8_e5m2", 2.0**-16, 0x01),
    ("fp8_e5m2", 1.0, 0x3C),
    ("fp6_e3m2", 28.0, 0x1F), ("fp6_e3m2", 0.0625, 0x01), ("fp6_e3m2", 0.25, 0x04), ("fp6_e3m2", -1.0, 0x2C),
    ("fp6_e2m3", 7.5, 0x1F), ("fp6_e2m3", 0.125, 0x01), ("fp6_e2m3", 1.0, 0x08), ("fp6_e2m3", -7.5, 0x3F),
    ("fp4_e2m1", 0.5, 1), ("fp4_e2m1", 1.0, 2), ("fp4_e2m1", 1.5, 3), ("fp4_e2m1", 2.0, 4), ("fp4_e2m1", 3.0, 5),
    ("fp4_e2m1", 4.0, 6), ("fp4_e2m1", 6.0, 7), ("fp4_e2m1", -6.0, 15),
    ("bf16", 1.0, 0x3F80), ("bf16", -2.0, 0xC000), ("fp16", 1.0, 0x3C00), ("fp16", 65504.0, 0x7BFF), ("fp16", 2.0**-24, 1),
    ("int8_mx", 1.0, 64), ("int8_mx", -1.0, 0xC0), ("int8_mx", 127 / 64, 127), ("int8_mx", -127 / 64, 0x81),
]  # fmt: skip


@pytest.mark.parametrize(("name", "value", "code"), KNOWN_CODES)
def test_known_encodings(name: str, value: float, code: int) -> None:
    enc = encode(torch.tensor([value]), name)
    assert enc.codes.item() == code
    assert same_bits(decode(enc), torch.tensor([value]))


def test_formats_without_nan_refuse_to_encode_nan() -> None:
    with pytest.raises(NumericsError, match="NaN"):
        encode(torch.tensor([1.0, math.nan]), "fp4_e2m1")


# --- rounding modes -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "fp4_e2m1"])
def test_truncate_rounds_toward_zero(name: str) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4000, generator=g) * 3
    t = quantize(x, name, rounding="truncate")
    r = quantize(x, name)
    assert (t.abs() <= x.abs()).all()
    assert (t.abs() <= r.abs()).all()
    assert (quantize(t, name) == t).all()  # still representable
    assert (t != r).any()


@pytest.mark.parametrize("name", ["bf16", "fp16", "fp8_e4m3", "bfp8_b", "mxfp4", "mxint8", "fp22"])
def test_stochastic_rounding_is_reproducible_unbiased_and_representable(name: str) -> None:
    x = torch.full((20000,), 1.0 + 1 / 3) * torch.tensor(0.8)
    if FORMATS[name].block_size:
        x[::16] = 1.5  # fix each block's scale
    a = quantize(x, name, rounding="stochastic", generator=torch.Generator().manual_seed(7))
    b = quantize(x, name, rounding="stochastic", generator=torch.Generator().manual_seed(7))
    c = quantize(x, name, rounding="stochastic", generator=torch.Generator().manual_seed(8))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert torch.equal(quantize(a, name), a)
    sel = x != 1.5
    down, up = a[sel].min(), a[sel].max()
    assert down < x[sel][0] < up  # only the two neighbours occur
    p_up = (a[sel] == up).float().mean().item()
    expect = ((x[sel][0] - down) / (up - down)).item()
    assert abs(p_up - expect) < 0.02


def test_stochastic_without_a_generator_is_an_error() -> None:
    with pytest.raises(NumericsError, match="Generator"):
        quantize(torch.ones(3), "bf16", rounding="stochastic")


# --- Tenstorrent bfp*_b, per tt-metal's host packer ------------------------------------------------


def bfp(values: list[float], name: str = "bfp8_b") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.tensor(values + [0.0] * (16 - len(values)))
    enc = encode(x, name)
    return enc.codes.flatten()[: len(values)], enc.scales.flatten(), quantize(x, name)[: len(values)]


def test_bfp8_shared_exponent_is_the_block_max_and_codes_are_sign_magnitude() -> None:
    codes, shared, q = bfp([1.0, 0.5, -0.75, 1.5])
    assert shared.tolist() == [127]
    assert codes.tolist() == [0x40, 0x20, 0x80 | 0x30, 0x60]
    assert q.tolist() == [1.0, 0.5, -0.75, 1.5]


def test_bfp8_small_values_lose_bits_to_the_shared_exponent() -> None:
    # 2^-8 in a block whose max is 1.0: 24-bit significand >> 8 then rounded to 7 bits -> 0
    _, _, q = bfp([1.0, 2.0**-7, 2.0**-6, 2.0**-6 * 1.5])
    assert q.tolist() == [1.0, 0.0, 2.0**-6, 2.0**-6 * 2]  # 1.5 * 2^-6 is a tie at the last bit: to even


def test_bfp8_saturates_the_magnitude_instead_of_bumping_the_exponent() -> None:
    _, shared, q = bfp([1.999, 1.0])
    assert shared.tolist() == [127]
    assert q[0].item() == 127 / 64


def test_bfp8_rounds_after_the_shift_so_dropped_bits_do_not_break_a_tie() -> None:
    # (1 + 2^-6 + 2^-23) * 2^-1 next to 1.0: shifting by 1 drops the 2^-23 bit, leaving an exact tie,
    # which rounds to even (0.5) although the true value is above the tie (tt-metal convert_u32_to_bfp)
    x = (1 + 2.0**-6 + 2.0**-23) * 0.5
    _, _, q = bfp([1.0, x])
    assert q[1].item() == 0.5
    assert quantize(torch.tensor([x]), "bf16").item() != 0.5  # a plain rounding would not


def test_bfp_exponent_zero_inputs_flush_and_zero_has_no_sign() -> None:
    codes, shared, q = bfp([1e-40, -1e-40, -0.0])  # fp32 subnormals and negative zero
    assert shared.tolist() == [0]
    assert codes.tolist() == [0, 0, 0]
    assert bits(q).tolist() == [0, 0, 0]


def test_bfp_block_with_inf_decodes_inf_and_flushes_the_rest() -> None:
    _, shared, q = bfp([math.inf, 1.0, -math.inf])
    assert shared.tolist() == [255]
    assert q.tolist() == [math.inf, 0.0, -math.inf]


def test_bfp_decode_follows_the_tt_metal_unpacker_for_codes_the_packer_never_makes() -> None:
    # exponent - shift_count == 0 writes the float32 denormal pattern; < 0 flushes to zero
    # (unpack_bfp8_tiles_into_float_vec)
    f = FORMATS["bfp8_b"]
    codes = torch.tensor([[3, 1]], dtype=torch.uint8)
    shared = torch.tensor([5], dtype=torch.uint8)
    enc = Encoded(f, torch.nn.functional.pad(codes, (0, 14)).view(1, 16), shared, None, (16,), 0)
    out = decode(enc)[:2]
    assert bits(out).tolist() == [0x00400000, 0]


@pytest.mark.parametrize(("name", "values", "expect"), [
    ("bfp4_b", [1.0, 0.3, -0.8, 1.9], [1.0, 0.25, -0.75, 1.75]),  # 3-bit magnitudes, 1.9 saturates at 1.75
    ("bfp2_b", [1.0, 0.3, -0.8, 1.9], [1.0, 0.0, -1.0, 1.0]),
])  # fmt: skip
def test_bfp4_and_bfp2(name: str, values: list[float], expect: list[float]) -> None:
    _, _, q = bfp(values, name)
    assert q.tolist() == expect


def test_bfp_truncate_is_tt_metals_truncate_bfp_mantissa() -> None:
    x = torch.tensor([1.0, 0.99, -0.99] + [0.0] * 13)
    assert quantize(x, "bfp4_b", rounding="truncate")[:3].tolist() == [1.0, 0.75, -0.75]
    assert quantize(x, "bfp4_b")[:3].tolist() == [1.0, 1.0, -1.0]


# --- OCP MX ---------------------------------------------------------------------------------------


def test_mx_scale_is_floor_log2_amax_minus_emax_elem() -> None:
    x = torch.zeros(4, 32)
    x[0, 0], x[1, 0], x[2, 0], x[3, 3] = 1.0, 448.0, 500.0, 2.0**-140
    enc = encode(x, "mxfp8_e4m3")
    assert enc.scales.flatten().tolist() == [127 - 8, 127, 127, 0]  # 2^-140 clamps to the E8M0 minimum
    q = quantize(x, "mxfp8_e4m3")
    assert q[:3, 0].tolist() == [1.0, 448.0, 448.0]  # 500 saturates to the element max


def test_mxfp4_floor_scale_clamps_the_block_max() -> None:
    x = torch.tensor([7.9, 1.0, 0.26] + [0.0] * 29)
    assert encode(x, "mxfp4").scales.item() == 127  # floor(log2 7.9) - 2 = 0
    assert quantize(x, "mxfp4")[:3].tolist() == [6.0, 1.0, 0.5]


def test_mxint8_elements_are_fixed_point_with_six_fraction_bits() -> None:
    x = torch.tensor([1.5, -1.0, 0.3, 2.0**-9] + [0.0] * 28)
    q = quantize(x, "mxint8")
    assert q[:4].tolist() == [1.5, -1.0, 19 / 64, 0.0]
    assert encode(x, "mxint8").codes.flatten()[:3].tolist() == [96, 0xC0, 19]


def test_mx_nan_or_inf_makes_the_whole_block_nan_and_only_that_block() -> None:
    x = torch.ones(2, 32)
    x[0, 5] = math.nan
    x[1, 7] = math.inf
    y = torch.ones(1, 32)
    for name in ("mxfp8_e4m3", "mxfp4", "mxint8"):
        enc = encode(torch.cat([x, y]), name)
        assert enc.scales.flatten().tolist() == [255, 255, 127 - FORMATS[FORMATS[name].element].emax]
        q = decode(enc)
        assert torch.isnan(q[:2]).all() and (q[2] == 1).all()


@pytest.mark.slow  # importing torchao takes ~8 s
def test_mx_matches_torchao_bit_for_bit() -> None:
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    from torchao.prototype.mx_formats.constants import DTYPE_FP6_E2M3, DTYPE_FP6_E3M2

    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 256, generator=g) * torch.logspace(-30, 30, 256)
    x[3, 40:48] = 0.0
    for name, dt in [("mxfp8_e4m3", torch.float8_e4m3fn), ("mxfp8_e5m2", torch.float8_e5m2),
                     ("mxfp6_e2m3", DTYPE_FP6_E2M3), ("mxfp6_e3m2", DTYPE_FP6_E3M2), ("mxfp4", torch.float4_e2m1fn_x2)]:  # fmt: skip
        scale, data = mx.to_mx(x, dt, 32)
        ref = mx.to_dtype(data, scale, dt, 32, torch.float32)
        assert same_bits(quantize(x, name), ref), name
        assert torch.equal(encode(x, name).scales.flatten(), scale.view(torch.uint8).flatten()), name


@pytest.mark.slow  # importing torchao takes ~8 s
def test_torchao_mx_disagreements_are_the_documented_ones() -> None:
    """torchao clamps the fp32 scale to 2^-126 when quantizing (E8M0 2^-127 encodes a subnormal), then
    decodes with 2^-127; and it saturates an infinity instead of giving the block a NaN scale."""
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    x = torch.zeros(32)
    x[0] = 2.0**-134  # amax so small that the scale is 2^-127
    scale, data = mx.to_mx(x.view(1, 32), torch.float8_e4m3fn, 32)
    theirs = mx.to_dtype(data, scale, torch.float8_e4m3fn, 32, torch.float32).flatten()[0].item()
    assert scale.view(torch.uint8).item() == 0
    assert theirs == 2.0**-135  # halved by the inconsistent 2^-126 / 2^-127 pair
    assert quantize(x, "mxfp8_e4m3")[0].item() == 2.0**-134
    x = torch.ones(32)
    x[0] = math.inf
    scale, _ = mx.to_mx(x.view(1, 32), torch.float8_e4m3fn, 32)
    assert scale.view(torch.uint8).item() != 255
    assert encode(x, "mxfp8_e4m3").scales.item() == 255


# --- NVFP4 ----------------------------------------------------------------------------------------


@pytest.mark.slow  # importing torchao takes ~8 s
def test_nvfp4_two_level_scales_match_torchao_bit_for_bit() -> None:
    nv = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, unpack_uint4

    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 256, generator=g) * torch.logspace(-3, 3, 256)
    ts = nv.per_tensor_amax_to_scale(x.abs().amax())
    sb, data = nv.nvfp4_quantize(x, 16, ts)
    vals = f4_unpacked_to_f32(unpack_uint4(data)).reshape(8, 16, 16)
    ref = (vals * (ts * sb.float()).reshape(8, 16, 1)).reshape(8, 256)
    enc = encode(x, "nvfp4")
    assert same_bits(quantize(x, "nvfp4"), ref)
    assert torch.equal(enc.scales, sb.view(torch.uint8))
    assert enc.tensor_scale.item() == ts.item()


def test_nvfp4_block_scale_is_e4m3_of_block_amax_over_6_over_tensor_scale() -> None:
    x = torch.zeros(32)
    x[0], x[16] = 6.0 * 448, 6.0  # tensor scale 1.0; block scales 448 and 1
    enc = encode(x, "nvfp4")
    assert enc.tensor_scale.item() == 1.0
    assert enc.scales.tolist() == [0x7E, 0x38]
    assert quantize(x, "nvfp4")[[0, 16]].tolist() == [6.0 * 448, 6.0]
    assert quantize(torch.zeros(16), "nvfp4").abs().sum().item() == 0.0


# --- every format: shape, axis, padding, round trips ------------------------------------------------

ALL = sorted(FORMATS)


@pytest.mark.parametrize("name", ALL)
def test_decode_encode_equals_quantize_and_quantize_is_idempotent(name: str) -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 5, 40, generator=g) * torch.logspace(-6, 6, 40)
    x[0, 0, :4] = torch.tensor([0.0, -0.0, 1e-42, -3e-39])
    q = quantize(x, name)
    assert q.shape == x.shape and q.dtype == torch.float32
    assert same_bits(decode(encode(x, name)), q)
    if name != "nvfp4":  # nvfp4's tensor scale follows the (changed) amax
        assert same_bits(quantize(q, name), q)


@pytest.mark.parametrize("name", ["bfp8_b", "mxfp4", "nvfp4", "mxint8"])
def test_blocks_run_along_axis_and_the_last_block_is_zero_padded(name: str) -> None:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(40, 6, generator=g)
    along0 = quantize(x, name, axis=0)
    assert same_bits(along0, quantize(x.t().contiguous(), name).t())
    size = FORMATS[name].block_size
    padded = torch.nn.functional.pad(x.t(), (0, 3 * size - 40))
    assert same_bits(along0.t(), quantize(padded, name)[:, :40])


@pytest.mark.parametrize("scaling", ["tensor", "block:16"])
def test_fp8_with_amax_scaling_uses_the_full_range(scaling: str) -> None:
    x = torch.linspace(-3e-3, 1e-3, 64).view(2, 32)
    q = quantize(x, "fp8_e4m3", scaling=scaling)
    assert (q - x).abs().max() <= x.abs().max() * 2.0**-4
    assert (quantize(x, "fp8_e4m3") - x).abs().max() > (q - x).abs().max()  # unscaled: subnormal range
    assert same_bits(decode(encode(x, "fp8_e4m3", scaling=scaling)), q)
    blocks = q.view(2, 2, 16) if scaling == "block:16" else q.view(1, 1, 64)
    amax_blocks = x.view_as(blocks).abs().amax(-1)
    assert torch.allclose(blocks.abs().amax(-1), amax_blocks, rtol=1e-6, atol=0)  # block max -> 448 -> back


def test_zero_dim_scalar_works_and_bad_input_names_the_problem() -> None:
    assert quantize(torch.tensor(1.0 + 2**-10), "bf16").item() == 1.0
    with pytest.raises(NumericsError, match="unknown number format 'fp7'.*bfp8_b"):
        quantize(torch.ones(2), "fp7")
    with pytest.raises(NumericsError, match="rounding"):
        quantize(torch.ones(2), "bf16", rounding="up")
    with pytest.raises(NumericsError, match="scaling"):
        quantize(torch.ones(2), "fp8_e4m3", scaling="channel")
    with pytest.raises(NumericsError, match="brings its own"):
        quantize(torch.ones(2), "mxfp4", scaling="tensor")
    with pytest.raises(NumericsError, match="axis"):
        quantize(torch.ones(2, 3), "mxfp4", axis=2)
    assert NumericsError.exit_code == 2


@pytest.mark.parametrize("name", ["bf16", "fp8_e4m3", "bfp8_b", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("rounding", ["rne", "stochastic"])
def test_large_tensors_are_processed_in_chunks_without_changing_a_bit(name: str, rounding: str) -> None:
    from firstlight.numerics.formats import CHUNK_ELEMENTS

    g = torch.Generator().manual_seed(9)
    x = torch.randn(3 * CHUNK_ELEMENTS // 64 + 5, 64, generator=g)

    def gen() -> torch.Generator | None:
        return torch.Generator().manual_seed(11) if rounding == "stochastic" else None

    q = quantize(x, name, rounding=rounding, generator=gen())
    assert same_bits(decode(encode(x, name, rounding=rounding, generator=gen())), q)  # encode runs unchunked


@pytest.mark.parametrize("name", ["bf16", "tf32", "fp22"])
@pytest.mark.parametrize("rounding", ["rne", "truncate"])
def test_in_place_accumulator_rounding_matches_quantize(name: str, rounding: str) -> None:
    from firstlight.numerics.scalar import round_e8_

    g = torch.Generator().manual_seed(12)
    x = torch.randn(5000, generator=g) * torch.logspace(-40, 38, 5000)
    specials = torch.tensor([0x7FFFFFFF, 0x7F800001, -(2**31) + 1, 0x7F7FFFFF], dtype=torch.int32).view(torch.float32)
    x = torch.cat([x, specials, torch.tensor([math.inf, -math.inf, -0.0, 1e-45])])
    out = round_e8_(x.clone(), FORMATS[name].man_bits, rounding, None)
    assert same_bits(out, quantize(x, name, rounding=rounding))
    assert torch.isnan(out[5000:5002]).all()  # NaN payloads never carry into the sign
