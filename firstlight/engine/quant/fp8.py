"""FP8 E4M3 weights and activations, emulated: values are rounded through torch.float8_e4m3fn
exactly as an FP8 tensor core would see them, and multiplied in the compute dtype.

E4M3 ("fn": finite, no infinities) holds magnitudes up to 448 (OCP FP8 spec, Micikevicius et al.
2022), so every tensor is scaled into range first and clamped explicitly (a cast of an
out-of-range value would give NaN rather than saturate):

    s_w[n] = max_k |W[n, k]| / 448          (per output channel; or one s_w per tensor)
    W8     = fp8(clamp(W / s_w, -448, 448))
    s_x[m] = max_k |x[m, k]| / 448          (per token, computed on the fly; or one per tensor)
    x8     = fp8(clamp(x / s_x, -448, 448))
    y      = (x8 @ W8^T) * s_x * s_w^T + bias

Kernels: `kernel="emulate"` (default, any device): upcast x8 and W8 and run F.linear, then apply the
scales. `kernel="scaled_mm"`: `torch._scaled_mm` on the FP8 tensors — the real FP8 GEMM on CUDA
compute capability 8.9+; torch 2.13 also has a CPU implementation, correct but slower than the
emulation (measured in benchmarks/quant_speed.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from firstlight.engine.quant.base import QuantizedModule, flatten_tokens, resolve_compute_dtype
from firstlight.engine.quant.registry import QuantFormat, QuantizationError, register_format, unsupported

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448.0
SCALINGS = ("channel", "tensor")  # weights
ACT_SCALINGS = ("token", "tensor")  # activations (dynamic)
KERNELS = ("emulate", "scaled_mm")


def quantize_fp8(x: torch.Tensor, per_row: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x8 [M, K] float8_e4m3fn, scale fp32 [M, 1] if per_row else [1, 1])."""
    x32 = x.float()
    amax = x32.abs().amax(dim=-1, keepdim=True) if per_row else x32.abs().amax().reshape(1, 1)
    scale = (amax / FP8_MAX).clamp(min=1e-12)
    return (x32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


class FP8Linear(QuantizedModule):
    def __init__(
        self, linear: nn.Linear, weight_scaling: str, act_scaling: str, kernel: str,
        compute_dtype: torch.dtype, kernel_name: str,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.act_per_token = act_scaling == "token"
        self.use_scaled_mm = kernel == "scaled_mm"
        self.compute_dtype, self.kernel = compute_dtype, kernel_name
        w8, w_scale = quantize_fp8(linear.weight.detach(), per_row=weight_scaling == "channel")
        self.register_buffer("weight_fp8", w8)  # [N, K]
        self.register_buffer("weight_scale", w_scale.t().contiguous())  # [1, N] or [1, 1]
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = flatten_tokens(x, torch.float32)  # [M, K]
        x8, x_scale = quantize_fp8(x2, per_row=self.act_per_token)  # [M, K], [M, 1] | [1, 1]
        if self.use_scaled_mm:
            # _scaled_mm takes either two tensor-wise scales or row-wise [M, 1] and [1, N] scales.
            if x_scale.numel() == 1 and self.weight_scale.numel() == 1:
                scale_a, scale_b = x_scale.reshape(()), self.weight_scale.reshape(())
            else:
                scale_a = x_scale.expand(x8.shape[0], 1).contiguous()
                scale_b = self.weight_scale.expand(1, self.out_features).contiguous()
            y = torch._scaled_mm(x8, self.weight_fp8.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=self.compute_dtype)
        else:
            y = F.linear(x8.to(self.compute_dtype), self.weight_fp8.to(self.compute_dtype))
            y = y * x_scale.to(self.compute_dtype) * self.weight_scale.to(self.compute_dtype)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def dequantized_weight(self) -> torch.Tensor:
        return self.weight_fp8.float() * self.weight_scale.t()

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, fp8 e4m3, {self.kernel}"


@register_format
class FP8E4M3(QuantFormat):
    name = "fp8"
    summary = "FP8 E4M3 weights (per channel) and activations (per token), scaled and clamped; emulated matmul"

    def __init__(
        self, weight_scaling: str = "channel", act_scaling: str = "token", kernel: str = "emulate",
        compute_dtype: str = "auto", **opts: Any,
    ) -> None:
        super().__init__(**opts)
        for value, allowed, what in ((weight_scaling, SCALINGS, "weight_scaling"),
                                     (act_scaling, ACT_SCALINGS, "act_scaling"), (kernel, KERNELS, "kernel")):
            if value not in allowed:
                raise QuantizationError(f"fp8 {what} must be one of {allowed}, got '{value}'")
        self.weight_scaling, self.act_scaling, self.kernel = weight_scaling, act_scaling, kernel
        self.compute_dtype = compute_dtype

    def kernel_path(self, device: torch.device, dtype: torch.dtype) -> str:
        cdt = resolve_compute_dtype(self.compute_dtype, device, dtype, dtype)
        scaling = f"w per-{self.weight_scaling}, x per-{self.act_scaling}"
        if self.kernel == "emulate":
            return f"emulated: float8_e4m3fn round-trip + F.linear in {str(cdt).removeprefix('torch.')} ({scaling})"
        if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
            raise unsupported(self.name, device, dtype, "torch._scaled_mm needs compute capability 8.9+ (use kernel='emulate')")
        if device.type not in ("cpu", "cuda"):
            raise unsupported(self.name, device, dtype, "torch._scaled_mm runs on CPU and CUDA only (use kernel='emulate')")
        return f"torch._scaled_mm ({device.type}, {scaling})"

    def quantize_linear(self, linear: nn.Linear) -> nn.Module:
        device, dtype = linear.weight.device, linear.weight.dtype
        kernel_name = self.kernel_path(device, dtype)
        cdt = resolve_compute_dtype(self.compute_dtype, device, dtype, dtype)
        if linear.weight.ndim != 2:
            raise QuantizationError(f"fp8: expected a 2-D weight, got {tuple(linear.weight.shape)}")
        return FP8Linear(linear, self.weight_scaling, self.act_scaling, self.kernel, cdt, kernel_name)
