"""firstlight::int8_mm (the CPU int8 weight-only linear and tied LM head): fp32 activations equal to the
fp64 product to fp32 accuracy, int8 activations (w4a8's head) equal to the product with the block-rounded
activations and within the rounding bound, aten where the kernel cannot take the layer or is switched off."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from firstlight import kernels
from firstlight.models.loader import load_model
from firstlight.quant import QuantizationError, get_format, quantize_model
from firstlight.quant.int8 import Int8Embedding, Int8WeightOnlyLinear, quantize_per_channel_int8

from .test_int4_kernel import kernel_isa, mode  # noqa: F401 - fixtures


def _case(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    w = torch.randn(n, k)
    w[0, 0] = 20.0  # a row with an outlier: its other codes are small
    q, scale = quantize_per_channel_int8(w, scale_dtype=torch.bfloat16)
    scale = scale.bfloat16()  # as Int8WeightOnlyLinear stores it on CPU
    return q, scale, q.double() * scale.double()[:, None]


@pytest.mark.parametrize("n,k", [(64, 128), (37, 96), (5, 32), (130, 576)])
# 2..: register tiles of up to 4 activation rows (M split evenly: 17 = 4 + 4 + 3 + 3 + 3); 130 > INT8_MAX_TILED_M:
# dequantize + mm
@pytest.mark.parametrize("m", [1, 2, 3, 4, 6, 17, 40, 70, 130])
def test_int8_mm_float_and_int8_activations(kernel_isa, m, n, k):  # noqa: F811
    q, scale, w = _case(n, k)
    x = torch.randn(m, k)
    x[0, 3] = 30.0
    y = kernels.int8_mm(x, q, scale, False)
    ref = x.double() @ w.t()
    assert y.dtype == torch.float32 and y.shape == (m, n)
    assert torch.allclose(y.double(), ref, rtol=0, atol=1e-5 * ref.abs().max().item())
    y8 = kernels.int8_mm(x, q, scale, True).double()
    ref8 = kernels.quantize_act_int8(x).double() @ w.t()
    assert torch.allclose(y8, ref8, rtol=0, atol=1e-5 * ref8.abs().max().item())  # integer dots are exact
    dx = x.double().reshape(m, -1, 32).abs().amax(-1) / 127
    bound = (dx.repeat_interleave(32, dim=1) / 2) @ w.abs().t()  # sum_k |W[n, k]| dx_b / 2
    err = (y8 - ref).abs()
    assert (err <= bound * (1 + 1e-5) + 1e-5 * ref.abs().max().item()).all()
    assert err.max() > 1e-3  # really rounded


def test_int8_linear_uses_ours_where_it_can(kernel_isa, mode):  # noqa: F811
    mode("auto")
    torch.manual_seed(1)
    fmt = get_format("int8")
    assert fmt.kernel_path(torch.device("cpu"), torch.float32).startswith(f"firstlight::int8_mm ({kernel_isa}")
    lin = nn.Linear(96, 40).requires_grad_(False)
    ql = fmt.quantize_linear(lin)
    assert isinstance(ql, Int8WeightOnlyLinear) and ql.ours and "firstlight::int8_mm" in ql.kernel
    x = torch.randn(3, 96)
    assert torch.allclose(ql(x), x @ ql.dequantized_weight().t() + lin.bias, atol=1e-5, rtol=1e-5)
    odd = fmt.quantize_linear(nn.Linear(40, 16))  # in_features not a multiple of 32: aten
    assert not odd.ours and "aten" in odd.kernel
    mode("aten")
    assert not get_format("int8").quantize_linear(lin).ours
    with pytest.raises(QuantizationError, match="int8 activations need firstlight's CPU kernel"):
        get_format("int8", activations="int8").kernel_path(torch.device("cpu"), torch.float32)
    with pytest.raises(QuantizationError, match="'float' or 'int8'"):
        get_format("int8", activations="fp8")


def test_w4a8_tied_head_is_our_int8_kernel_with_float_activations(kernel_isa, mode, tiny_dirs):  # noqa: F811
    mode("auto")
    model, _ = load_model(tiny_dirs["qwen2"], with_tokenizer=False)
    quantize_model(model, "w4a8")
    head = model.lm_head
    assert isinstance(head, Int8WeightOnlyLinear) and head.ours and head.activations == "float"
    body = [m for n, m in model.named_modules() if n != "lm_head" and hasattr(m, "activations")]
    assert body and all(m.activations == "int8" for m in body)  # the int4 layers take int8 activations
    assert isinstance(model.embed_tokens, Int8Embedding)
    assert model.embed_tokens.qweight.data_ptr() == head.qweight.data_ptr()
    x = torch.randn(2, head.in_features)
    ref = x @ head.dequantized_weight().t()
    assert torch.allclose(head(x), ref, atol=1e-5, rtol=1e-5)
