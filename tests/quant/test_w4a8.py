"""w4a8: firstlight::int4_mm_a8 (int4 weights x int8 activations per block of 32) returns W~ x^ (x^ the
block-rounded activations) to fp32 accuracy, stays within the rounding bound sum_k |W~[n, k]| dx_b / 2 of
the fp32-activation product, is one opaque op under torch.compile, and is refused (not silently replaced)
where firstlight's kernel is not in use."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from firstlight import kernels
from firstlight.quant import QuantizationError, get_format
from firstlight.quant.int4 import dequantize_groupwise_int4, quantize_groupwise_int4

from .test_int4_kernel import kernel_isa, mode  # noqa: F401 - fixtures


def _case(n: int, k: int, g: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(seed)
    w = torch.randn(n, k) / k**0.5
    w[0, 0] = 3.0  # an outlier group
    q, scale, zero = quantize_groupwise_int4(w, g, param_dtype=torch.bfloat16)
    return kernels.pack_int4(q, scale, zero, g), dequantize_groupwise_int4(q, scale, zero, g).double()


def _acts(m: int, k: int) -> torch.Tensor:
    x = torch.randn(m, k)
    x[0, 5] = 40.0  # an outlier channel: its block's dx is large
    if k >= 64:
        x[-1, 32:64] = 0.0  # an all-zero block: dx = 0, no division by zero
    return x


def test_activation_rounding_reference():
    x = _acts(3, 96)
    xh = kernels.quantize_act_int8(x)
    blocks = x.reshape(3, -1, 32)
    dx = blocks.abs().amax(-1, keepdim=True) / 127
    err = (xh.reshape(3, -1, 32) - blocks).abs()
    assert (err <= dx / 2 * (1 + 1e-6) + 1e-12).all()  # round to nearest on the grid dx * (-127..127)
    codes = xh.reshape(3, -1, 32) / torch.where(dx > 0, dx, 1)
    assert torch.allclose(codes, codes.round(), atol=1e-4) and codes.abs().max() <= 127 + 1e-4
    assert (xh[-1, 32:64] == 0).all() and torch.isfinite(xh).all()


@pytest.mark.parametrize("n,k,g", [(64, 128, 32), (40, 96, 32), (19, 256, 64), (7, 256, 128), (24, 512, 256)])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9, 17, 40])
def test_int4_mm_a8_is_the_product_with_rounded_activations(kernel_isa, m, n, k, g):  # noqa: F811
    (packed, d, mins), w = _case(n, k, g)
    x = _acts(m, k)
    y = kernels.int4_mm_a8(x, packed, d, mins, g)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    xh = kernels.quantize_act_int8(x).double()
    ref = xh @ w.t()
    # the integer dot products are exact; what is left is fp32 scaling and summation
    assert torch.allclose(y.double(), ref, rtol=0, atol=1e-5 * ref.abs().max().item() + 1e-6)
    # vs the fp32-activation product: within the activation rounding bound, sum_k |W~[n, k]| * dx_b / 2
    exact = x.double() @ w.t()
    dx = x.double().reshape(m, -1, 32).abs().amax(-1) / 127  # [M, K/32]
    bound = (dx.repeat_interleave(32, dim=1) / 2) @ w.abs().t()
    err = (y.double() - exact).abs()
    assert (err <= bound * (1 + 1e-5) + 1e-5 * exact.abs().max().item()).all()
    assert err.max() > 1e-4  # and the activations really were rounded (not the fp32 path)


def test_int4_mm_a8_large_m_matches_tiled(kernel_isa):  # noqa: F811
    (packed, d, mins), _ = _case(48, 128, 32)
    x = _acts(kernels.A8_MAX_TILED_M + 5, 128)
    y = kernels.int4_mm_a8(x, packed, d, mins, 32)
    tiled = torch.cat([kernels.int4_mm_a8(x[i:i + 4], packed, d, mins, 32) for i in range(0, len(x), 4)])
    assert torch.allclose(y, tiled, rtol=1e-5, atol=1e-5)


def test_w4a8_linear(kernel_isa, mode):  # noqa: F811
    mode("auto")
    torch.manual_seed(1)
    lin = nn.Linear(96, 40, bias=True).requires_grad_(False)
    fmt = get_format("w4a8", group_size=32)
    assert fmt.kernel_path(torch.device("cpu"), torch.float32).startswith(f"firstlight::int4_mm_a8 ({kernel_isa}")
    ql = fmt.quantize_linear(lin)
    assert ql.ours and ql.activations == "int8" and "int8 activations" in repr(ql)
    # the same weight as the int4 format's
    assert torch.equal(ql.dequantized_weight(), get_format("int4", group_size=32).quantize_linear(lin).dequantized_weight())
    x = torch.randn(2, 3, 96)
    ref = kernels.quantize_act_int8(x.reshape(6, 96)) @ ql.dequantized_weight().t() + lin.bias
    assert torch.allclose(ql(x).reshape(6, 40), ref, atol=1e-5, rtol=1e-5)


def test_w4a8_refused_without_our_kernel(mode):  # noqa: F811
    mode("aten")
    fmt = get_format("w4a8")
    with pytest.raises(QuantizationError, match="w4a8.*FIRSTLIGHT_CPU_KERNELS=aten.*use int4"):
        fmt.kernel_path(torch.device("cpu"), torch.float32)
    with pytest.raises(QuantizationError, match="w4a8.*CPU only"):
        fmt.kernel_path(torch.device("cuda"), torch.bfloat16)


# ---- the tiled (VNNI) layout (kernels.pack_int4_vnni; csrc/int4_vnni.cpp): 16 output rows per int32 register,
# vpdpbusd on AVX-512 VNNI, maddubs + madd on AVX2 (FIRSTLIGHT_CPU_KERNELS_ISA=avx2 runs these on a VNNI CPU)

VNNI_CASES = [(64, 128, 32), (48, 96, 32), (16, 256, 64), (32, 256, 128), (16, 512, 256)]


@pytest.fixture()
def vnni(kernel_isa):  # noqa: F811
    if kernel_isa not in kernels.TILED_ISAS:
        pytest.skip(f"the tiled w4a8 kernel is built for AVX2 and AVX-512 VNNI (this library: {kernel_isa})")


@pytest.mark.parametrize("n,k,g", VNNI_CASES)
def test_vnni_layout_holds_the_same_weight(kernel_isa, n, k, g):  # noqa: F811
    (packed, d, mins), _ = _case(n, k, g)
    vp, vd, vm = kernels.pack_int4_vnni(packed, d, mins)
    assert vp.shape == (n // 16, k // 8, 64) and vd.shape == vm.shape == (n // 16, k // g, 16)
    # the dequantization of either layout (fma(q, d, m) per weight) is the same weight, bit for bit
    assert torch.equal(kernels.int4_dequant(vp, vd, vm, g), kernels.int4_dequant(packed, d, mins, g))
    with pytest.raises(QuantizationError, match="multiple of 16"):
        kernels.pack_int4_vnni(packed[: n - 8], d[: n - 8], mins[: n - 8])


@pytest.mark.parametrize("n,k,g", VNNI_CASES)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9, 17, 40, 130])  # 1: four row tiles at a time; else 2; M in tiles of 4
def test_vnni_int4_mm_a8_is_the_product_with_rounded_activations(vnni, m, n, k, g):
    (packed, d, mins), w = _case(n, k, g)
    vp, vd, vm = kernels.pack_int4_vnni(packed, d, mins)
    x = _acts(m, k)
    y = kernels.int4_mm_a8(x, vp, vd, vm, g)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    ref = kernels.quantize_act_int8(x).double() @ w.t()
    assert torch.allclose(y.double(), ref, rtol=0, atol=1e-5 * ref.abs().max().item() + 1e-6)
    # the row-major kernel computes the same product (the integer sums are exact in both)
    rowmajor = kernels.int4_mm_a8(x, packed, d, mins, g)
    assert torch.allclose(y, rowmajor, rtol=0, atol=2e-5 * ref.abs().max().item() + 1e-6)


def test_vnni_rejects_bad_shapes(vnni):
    (packed, d, mins), _ = _case(32, 128, 32)
    vp, vd, vm = kernels.pack_int4_vnni(packed, d, mins)
    with pytest.raises(RuntimeError, match=r"x must be \[M, 128\]"):
        kernels.int4_mm_a8(torch.randn(2, 96), vp, vd, vm, 32)
    with pytest.raises(RuntimeError, match="scales/mins must be contiguous fp32"):
        kernels.int4_mm_a8(torch.randn(2, 128), vp, d, mins, 32)  # row-major scales with VNNI codes


def test_w4a8_linear_takes_the_vnni_layout(vnni, mode):  # noqa: F811
    mode("auto")
    torch.manual_seed(2)
    lin = nn.Linear(96, 48, bias=True).requires_grad_(False)
    fmt = get_format("w4a8", group_size=32)
    assert "16 rows per" in fmt.kernel_path(torch.device("cpu"), torch.float32)
    assert fmt.buffer_layout(torch.device("cpu")) == "firstlight-int4-vnni-v1"
    ql = fmt.quantize_linear(lin)
    assert ql.packed.shape == (3, 12, 64) and ql.scales.shape == (3, 3, 16)
    assert torch.equal(ql.dequantized_weight(), get_format("int4", group_size=32).quantize_linear(lin).dequantized_weight())
    x = torch.randn(2, 5, 96)
    ref = kernels.quantize_act_int8(x.reshape(10, 96)) @ ql.dequantized_weight().t() + lin.bias
    assert torch.allclose(ql(x).reshape(10, 48), ref, atol=1e-5, rtol=1e-5)
    out = torch.compile(ql, fullgraph=True)(x)  # the fake kernel knows the VNNI layout's N
    assert out.shape == (2, 5, 48) and torch.allclose(out, ql(x), atol=1e-6)
    torch._dynamo.reset()
    # rows not a multiple of 16 keep the row-major layout
    assert fmt.quantize_linear(nn.Linear(96, 40).requires_grad_(False)).packed.dim() == 2
