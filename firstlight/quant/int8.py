"""int8 weight-only, symmetric per output channel (as in gpt-fast / torchao `int8_weight_only`).

    scale[n] = max_k |W[n, k]| / 127
    Q[n, k]  = clamp(round(W[n, k] / scale[n]), -127, 127)      (int8)
    y        = (x @ Q^T) * scale + bias

Kernel: on CPU, by default firstlight's `firstlight::int8_mm` (kernels/csrc/int4_gemv.cpp, the same
extension and FIRSTLIGHT_CPU_KERNELS switch as int4; in_features a multiple of 32): the same Q and scale,
fp32 activations, or with activations="int8" (the tied head of w4a8) activations rounded to int8 per block
of 32 and integer dot products. Otherwise `torch.ops.aten._weight_int8pack_mm(x [M, K], Q [N, K] int8,
scale [N])` on CPU and CUDA. On CPU in torch 2.13 its vectorized path is the bf16 one: fp32 activations take a slow path (about
20x slower than an fp32 matmul at M=1, measured in benchmarks/quant_speed.py), so by default
activations enter the kernel in bfloat16 on CPU (`compute_dtype="auto"`); pass
compute_dtype="float32" for the exact-activation path.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from firstlight import kernels
from firstlight.quant.base import QuantizedModule, flatten_tokens, resolve_compute_dtype
from firstlight.quant.registry import QuantFormat, QuantizationError, register_format, unsupported

QMAX = 127.0


def int8_scales(w: torch.Tensor, scale_dtype: torch.dtype = torch.float32, qmax: float = QMAX) -> torch.Tensor:
    """One symmetric scale per row of w [N, K]: max |W[n, :]| / qmax (127), rounded to the dtype the
    kernel stores it in (so codes are chosen against the scale the kernel will really use)."""
    return (w.detach().float().abs().amax(dim=1) / qmax).clamp(min=1e-12).to(scale_dtype).float()


def quantize_per_channel_int8(
    w: torch.Tensor, scale: torch.Tensor | None = None, scale_dtype: torch.dtype = torch.float32,
    qmax: float = QMAX,
) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (Q [N, K] int8 in -qmax..qmax, scale [N] fp32), symmetric, one scale per row (given or fitted)."""
    w32 = w.detach().float()
    scale = int8_scales(w32, scale_dtype, qmax) if scale is None else scale.float()
    q = torch.round(w32 / scale[:, None]).clamp(-qmax, qmax).to(torch.int8)
    return q, scale


class Int8ChannelGrid:
    """The int8 grid for GPTQ: symmetric, one scale per output channel, fitted on the whole row."""

    group_size = None

    def __init__(self, scale_dtype: torch.dtype = torch.float32, qmax: float = QMAX) -> None:
        self.scale_dtype, self.qmax = scale_dtype, qmax

    def fit(self, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (int8_scales(w, self.scale_dtype, self.qmax),)

    def round(self, w: torch.Tensor, params: tuple[torch.Tensor, ...]) -> torch.Tensor:
        s = params[0][:, None]
        return torch.round(w / s).clamp(-self.qmax, self.qmax) * s


def uses_our_int8_kernel(linear: nn.Linear) -> bool:
    """firstlight::int8_mm takes this layer: CPU, in_features % 32 == 0, the extension in use."""
    return (linear.weight.device.type == "cpu" and linear.in_features % kernels.BLOCK == 0
            and kernels.load_kernel() is not None)


class Int8WeightOnlyLinear(QuantizedModule):
    def __init__(
        self, linear: nn.Linear, compute_dtype: torch.dtype, kernel: str, params: tuple[torch.Tensor, ...] | None = None,
        activations: str = "float",
    ) -> None:
        """params: (scale [N],) from a calibrated method (GPTQ, whose weights already lie on that grid).
        activations "int8": rounded per block of 32 (firstlight's CPU kernel only)."""
        super().__init__()
        self.ours = uses_our_int8_kernel(linear)
        if activations == "int8" and not self.ours:
            raise QuantizationError("int8 activations need firstlight's CPU kernel (in_features a multiple of 32)")
        self.activations = activations
        if self.ours:
            kernel = f"firstlight::int8_mm ({kernels.load_kernel()}, {'int8' if activations == 'int8' else 'float32'} activations)"
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.compute_dtype, self.kernel = compute_dtype, kernel
        q, scale = quantize_per_channel_int8(linear.weight, None if params is None else params[0], compute_dtype)
        self.register_buffer("qweight", q)  # [N, K] int8
        self.register_buffer("scales", scale.to(compute_dtype))  # [N]
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ours:
            y = kernels.int8_mm(flatten_tokens(x, torch.float32), self.qweight, self.scales, self.activations == "int8")
        else:
            x2 = flatten_tokens(x, self.compute_dtype)  # [M, K]
            y = torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scales)  # [M, N]
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def dequantized_weight(self) -> torch.Tensor:
        return self.qweight.float() * self.scales.float()[:, None]

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, int8 per-channel, {self.kernel}"


class Int8Embedding(QuantizedModule):
    """nn.Embedding with int8 rows and one scale per row; a lookup dequantizes only the rows it reads.

    Shares Q and scale with a tied int8 lm_head (same per-row layout), so tying still saves memory.
    """

    kernel = "int8 row gather + dequantize"

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("qweight", qweight)  # [V, E] int8
        self.register_buffer("scales", scales)  # [V]
        self.out_dtype = out_dtype

    @classmethod
    def from_embedding(cls, emb: nn.Embedding) -> Int8Embedding:
        q, scale = quantize_per_channel_int8(emb.weight)
        return cls(q, scale, emb.weight.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(ids, self.qweight).to(torch.float32)  # [..., E]
        return (rows * F.embedding(ids, self.scales[:, None]).float()).to(self.out_dtype)

    def dequantized_weight(self) -> torch.Tensor:
        return self.qweight.float() * self.scales.float()[:, None]


@register_format
class Int8WeightOnly(QuantFormat):
    name = "int8"
    summary = "int8 weights, symmetric per output channel; activations unquantized (aten._weight_int8pack_mm)"

    def __init__(self, compute_dtype: str = "auto", activations: str = "float", **opts: Any) -> None:
        super().__init__(**opts)
        if activations not in ("float", "int8"):
            raise QuantizationError(f"int8 activations must be 'float' or 'int8', got {activations!r}")
        self.compute_dtype, self.activations = compute_dtype, activations

    def kernel_path(self, device: torch.device, dtype: torch.dtype) -> str:
        cdt = resolve_compute_dtype(self.compute_dtype, device, dtype, torch.bfloat16)
        isa = kernels.load_kernel() if device.type == "cpu" else None
        if self.activations == "int8":
            if isa is None:
                raise unsupported(self.name, device, dtype, "int8 activations need firstlight's CPU kernel "
                                  f"({kernels.ENV}={kernels.kernel_mode()} or not built there)")
            return f"firstlight::int8_mm ({isa}, int8 activations per block of 32)"
        if isa is not None:
            return f"firstlight::int8_mm ({isa}, float32 activations; aten for in_features not a multiple of 32)"
        if device.type not in ("cpu", "cuda"):
            raise unsupported(self.name, device, dtype, "aten._weight_int8pack_mm has CPU and CUDA kernels only")
        return f"aten._weight_int8pack_mm ({device.type}, {str(cdt).removeprefix('torch.')} activations)"

    def grid(self, device: torch.device, dtype: torch.dtype) -> Int8ChannelGrid:
        return Int8ChannelGrid(resolve_compute_dtype(self.compute_dtype, device, dtype, torch.bfloat16))

    def quantize_linear(self, linear: nn.Linear, params: tuple[torch.Tensor, ...] | None = None) -> nn.Module:
        device, dtype = linear.weight.device, linear.weight.dtype
        cdt = resolve_compute_dtype(self.compute_dtype, device, dtype, torch.bfloat16)
        if linear.weight.ndim != 2:
            raise QuantizationError(f"int8: expected a 2-D weight, got {tuple(linear.weight.shape)}")
        return Int8WeightOnlyLinear(linear, cdt, self.kernel_path(device, dtype), params, self.activations)
