"""Each format's matmul against fp32: the packed kernels equal a dequantize-then-matmul reference
(same numbers, up to the kernel's output rounding), and the quantization error stays within the
bound the format's step size implies."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from firstlight.quant import QuantizationError, get_format
from firstlight.quant import w8a8 as w8a8_mod
from firstlight.quant.fp8 import FP8_MAX, quantize_fp8
from firstlight.quant.int4 import dequantize_groupwise_int4, quantize_groupwise_int4
from firstlight.quant.int8 import quantize_per_channel_int8
from firstlight.quant.w8a8 import fbgemm_exact_8x8, qmax_pair


def _linear(n: int, k: int, bias: bool = True, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias).requires_grad_(False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k) / k**0.5)
        lin.weight[0, 0] = 3.0  # an outlier, so per-channel scales differ
    return lin


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.bfloat16().float()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("compute_dtype", ["bfloat16", "float32"])
def test_int8_kernel_equals_dequantized_reference(compute_dtype):
    lin = _linear(96, 64)
    q = get_format("int8", compute_dtype=compute_dtype).quantize_linear(lin)
    x = torch.randn(2, 5, 64)
    # codes are chosen against the scale as the kernel stores it (bf16 on the default CPU path)
    codes, scale = quantize_per_channel_int8(lin.weight, scale_dtype=getattr(torch, compute_dtype))
    assert torch.equal(q.qweight, codes) and torch.equal(q.scales.float(), scale)
    # Reference: the same activations and scales (in the compute dtype), an fp32 matmul.
    cast = _bf16 if compute_dtype == "bfloat16" else (lambda t: t)
    ref = cast(x) @ (codes.float() * cast(scale)[:, None]).t() + lin.bias
    out = q(x)
    assert out.shape == (2, 5, 96) and out.dtype == torch.float32
    tol = 2e-2 if compute_dtype == "bfloat16" else 1e-5  # bf16 output rounding vs none
    assert torch.allclose(out, ref, rtol=tol, atol=tol * ref.abs().max().item())


def test_int8_error_vs_fp32_within_step_bound():
    lin = _linear(128, 256)
    q = get_format("int8", compute_dtype="float32").quantize_linear(lin)
    w_err = (q.dequantized_weight() - lin.weight).abs()
    step = lin.weight.abs().amax(1, keepdim=True) / 127
    assert bool((w_err <= step / 2 + 1e-7).all())  # round to nearest: at most half a step
    x = torch.randn(16, 256)
    # |y - y_ref|[m, n] <= sum_k |x[m, k]| * step[n] / 2, the worst case of round-to-nearest.
    bound = x.abs() @ (step / 2).expand_as(lin.weight).t() + 1e-5
    assert bool(((q(x) - lin(x)).abs() <= bound).all())
    assert _rel(q(x), lin(x)) < 0.02


def test_int4_kernel_equals_dequantized_reference():
    lin = _linear(64, 128)
    q = get_format("int4", group_size=32, clip_search=True).quantize_linear(lin)
    # codes are chosen against the bf16 scales and zeros the kernel stores
    codes, scale, zero = quantize_groupwise_int4(lin.weight, 32, clip_search=True, param_dtype=torch.bfloat16)
    assert int(codes.min()) >= 0 and int(codes.max()) <= 15
    assert torch.equal(_bf16(scale), scale) and torch.equal(_bf16(zero), zero)
    w_ref = dequantize_groupwise_int4(codes, scale, zero, 32)
    x = torch.randn(3, 7, 128)
    ref = _bf16(x) @ w_ref.t() + lin.bias
    out = q(x)
    assert out.shape == (3, 7, 64)
    assert torch.allclose(out, ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
    # The kernel's own view of the weight (probed with the identity) is the reference weight.
    assert torch.allclose(q.dequantized_weight(), w_ref, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("group_size", [32, 64])
def test_int4_error_vs_fp32_within_step_bound(group_size):
    lin = _linear(64, 256)
    codes, scale, zero = quantize_groupwise_int4(lin.weight, group_size)
    w = dequantize_groupwise_int4(codes, scale, zero, group_size)
    step = scale.t().repeat_interleave(group_size, dim=1)  # [N, K]
    assert bool(((w - lin.weight).abs() <= step / 2 + 1e-6).all())
    q = get_format("int4", group_size=group_size, compute_dtype="float32", clip_search=False).quantize_linear(lin)
    x = torch.randn(8, 256)
    bound = x.abs() @ (step / 2).t() + 1e-4
    assert bool(((q(x) - lin(x)).abs() <= bound).all())
    assert _rel(q(x), lin(x)) < 0.15  # 4 bits: ~ 1/15 of each group's range per weight


def test_int4_clip_search_never_increases_group_error():
    lin = _linear(64, 256)
    errs = []
    for clip in (False, True):
        codes, scale, zero = quantize_groupwise_int4(lin.weight, 32, clip_search=clip)
        w = dequantize_groupwise_int4(codes, scale, zero, 32)
        errs.append(((w - lin.weight) ** 2).reshape(64, 8, 32).sum(-1))  # per group
    assert bool((errs[1] <= errs[0] + 1e-9).all()) and errs[1].sum() < errs[0].sum()


def test_fp8_round_trip_scaling_and_clamping():
    x = torch.tensor([[0.0, 1e-3, -2.5, 1000.0], [5.0, -5.0, 0.5, 0.25]])
    x8, scale = quantize_fp8(x, per_row=True)
    assert x8.dtype == torch.float8_e4m3fn and scale.shape == (2, 1)
    back = x8.float() * scale
    assert torch.isfinite(back).all()
    assert torch.allclose(back.abs().amax(1), x.abs().amax(1))  # the row max maps to 448 exactly
    assert bool(((back - x).abs() <= x.abs() * 2**-4 + scale * 2**-9).all())  # 3 mantissa bits: half-ulp 1/16
    # Per-tensor: one scale; values beyond the scale's range are clamped, never NaN.
    x8t, st = quantize_fp8(x, per_row=False)
    assert st.numel() == 1 and float(x8t.float().abs().max()) == FP8_MAX


@pytest.mark.parametrize("weight_scaling,act_scaling", [("channel", "token"), ("tensor", "tensor"), ("channel", "tensor")])
def test_fp8_emulation_and_scaled_mm_agree_and_bound_error(weight_scaling, act_scaling):
    lin = _linear(48, 64)
    emu = get_format("fp8", weight_scaling=weight_scaling, act_scaling=act_scaling, block_size=0).quantize_linear(lin)
    smm = get_format("fp8", weight_scaling=weight_scaling, act_scaling=act_scaling, kernel="scaled_mm").quantize_linear(lin)
    x = torch.randn(4, 64)
    # Reference: dequantize both operands explicitly, fp32 matmul.
    x8, sx = quantize_fp8(x, per_row=act_scaling == "token")
    ref = (x8.float() * sx) @ emu.dequantized_weight().t() + lin.bias
    assert torch.allclose(emu(x), ref, rtol=1e-5, atol=1e-5)
    assert torch.allclose(smm(x), ref, rtol=1e-4, atol=1e-4)
    assert _rel(emu(x), lin(x)) < 0.06  # two E4M3 roundings of ~3% worst case each


def test_formats_keep_leading_dims_and_no_bias():
    lin = _linear(64, 64, bias=False)
    x = torch.randn(2, 3, 64)
    for name in ("int8", "int4", "fp8"):
        out = get_format(name).quantize_linear(lin)(x)
        assert out.shape == (2, 3, 64) and torch.isfinite(out).all()


def test_fp8_block_scaling_matches_reference_and_beats_per_channel_with_an_outlier_channel():
    torch.manual_seed(5)
    lin = _linear(64, 128)
    x = torch.randn(6, 128)
    x[:, 3] *= 300  # one outlier channel: per-token scaling pushes the others toward subnormals
    block = get_format("fp8", block_size=32).quantize_linear(lin)
    plain = get_format("fp8", block_size=0).quantize_linear(lin)
    assert block.weight_scale.shape == (64, 4) and "32" in block.kernel
    # reference: each operand quantized per (row, 32-block) by hand
    def fq(t):
        b = t.reshape(t.shape[0], -1, 32)
        s = (b.abs().amax(-1, keepdim=True) / 448).clamp(min=1e-12)
        return ((b / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s).reshape(t.shape)
    ref = fq(x) @ fq(lin.weight.detach()).t() + lin.bias
    torch.testing.assert_close(block(x), ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(block.dequantized_weight(), fq(lin.weight.detach()))
    exact = lin(x)
    assert _rel(block(x), exact) < _rel(plain(x), exact)


def test_fp8_block_size_errors():
    with pytest.raises(QuantizationError, match="block_size"):
        get_format("fp8", block_size=48)
    with pytest.raises(QuantizationError, match="emulate"):
        get_format("fp8", block_size=32, kernel="scaled_mm")
    with pytest.raises(QuantizationError, match="multiple of block_size"):
        get_format("fp8", block_size=32).quantize_linear(_linear(8, 48))


@pytest.mark.parametrize("weight_bits", [7, 8])
def test_w8a8_equals_exact_integer_arithmetic_per_token(weight_bits):
    """fbgemm's result is the exact int32 sum of per-token int8 activations x per-channel int8 weights
    (no vpmaddubsw saturation with one side at 7 bits), scaled back; fp32 output rounding only."""
    lin = _linear(96, 64)
    q = get_format("w8a8", weight_bits=weight_bits).quantize_linear(lin)
    qw, qx = qmax_pair(weight_bits)  # 8: (127, 127) where fbgemm's VNNI kernels cannot saturate, else (127, 63)
    assert (qw, qx) == ((63, 127) if weight_bits == 7 else (127, 127 if fbgemm_exact_8x8() else 63))
    codes, scale = quantize_per_channel_int8(lin.weight, qmax=qw)
    assert int(codes.abs().max()) == qw and torch.equal(q.weight_scale, scale)
    assert torch.equal(q.dequantized_weight(), codes.float() * scale[:, None])
    x = torch.randn(3, 5, 64) * torch.linspace(0.1, 4, 64)  # per-channel spread, like real activations
    s = x.abs().amax(-1, keepdim=True) / qx
    xq = torch.round(x / s)
    exact = (xq.double() @ codes.double().t()) * s.double() * scale.double() + lin.bias.double()
    out = q(x)
    assert out.shape == (3, 5, 96) and out.dtype == torch.float32
    assert torch.allclose(out.double(), exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item())
    assert _rel(out, lin(x)) < 0.05


def test_w8a8_default_bits_follow_the_fbgemm_probe(monkeypatch):
    """8-bit codes on both sides only where the worst case (every code 127) comes out exact; 7-bit weights else."""
    assert get_format("w8a8").weight_bits == (8 if fbgemm_exact_8x8() else 7)
    monkeypatch.setattr(w8a8_mod, "fbgemm_exact_8x8", lambda: False)  # an AVX2 CPU: vpmaddubsw would saturate
    assert get_format("w8a8").weight_bits == 7 and qmax_pair(8) == (127, 63)
    monkeypatch.setattr(w8a8_mod, "fbgemm_exact_8x8", lambda: True)
    assert get_format("w8a8").weight_bits == 8 and qmax_pair(8) == (127, 127) and qmax_pair(7) == (63, 127)


def test_w8a8_token_result_does_not_depend_on_its_batch():
    lin = _linear(64, 128)
    q = get_format("w8a8").quantize_linear(lin)
    x = torch.randn(6, 128)
    big = torch.cat([x[:1], 100 * torch.randn(5, 128)])  # companions with a far larger range
    assert torch.equal(q(x[:1]), q(big)[:1])  # per-token scales: same codes, same result


def test_w8a8_state_dict_round_trip_carries_the_codes():
    lin = _linear(32, 64)
    q = get_format("w8a8").quantize_linear(lin)
    state = q.state_dict()
    assert state["qweight"].dtype == torch.int8 and state["qweight"].shape == (32, 64)
    other = get_format("w8a8").quantize_linear(_linear(32, 64, seed=1))
    other.load_state_dict(state)
    x = torch.randn(4, 64)
    assert torch.equal(other(x), q(x))
    assert q.storage_bytes() == 32 * 64 + 4 * 32 + 4 * 32  # codes + scales + bias


def test_w8a8_exact_channels_are_multiplied_in_fp32():
    """Outlier input channels (LLM.int8()) leave the int8 GEMM: their contribution is exact, the rest's
    per-token scale no longer sees them."""
    lin = _linear(48, 64)
    exact = torch.tensor([3, 17])
    scale = quantize_per_channel_int8(lin.weight.index_fill(1, exact, 0.0), qmax=63)[1]
    q = get_format("w8a8", weight_bits=7).quantize_linear(lin, (scale, exact))
    x = torch.randn(5, 64)
    x[:, exact] *= 50  # outliers: they would take the whole int8 range of every token
    plain = get_format("w8a8", weight_bits=7).quantize_linear(lin)
    assert _rel(q(x), lin(x)) < _rel(plain(x), lin(x)) / 3
    w = q.dequantized_weight()
    assert torch.equal(w[:, exact], lin.weight[:, exact])
    rest = x.index_fill(1, exact, 0.0)
    s = rest.abs().amax(-1, keepdim=True) / 127
    codes = torch.round(lin.weight.index_fill(1, exact, 0.0) / scale[:, None]).clamp(-63, 63)
    ref = (torch.round(rest / s) @ codes.t()) * s * scale + x[:, exact] @ lin.weight[:, exact].t() + lin.bias
    assert torch.allclose(q(x), ref, rtol=1e-5, atol=1e-4)
    state = q.state_dict()  # a plain (RTN) layer takes the calibrated one's exact channels from its state
    plain.load_state_dict(state)
    assert torch.equal(plain(x), q(x))
