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

Block scaling (`block_size=32`, the default with kernel="emulate"; the granularity of OCP Microscaling MXFP8 and of DeepSeek-V3's
1x128 activation tiles, with fp32 scales): one scale per (row, block of B input channels) for the
weight and per (token, block of B channels) for the activations, so that an outlier channel no
longer pushes the rest of its row or token into E4M3's subnormal range:

    y[m, n] = sum_b (x8[m, b] . W8[n, b]) * s_x[m, b] * s_w[n, b]

On SmolLM2-135M it roughly halves the mean KL of both the weight and the activation rounding
(docs/QUANT.md); `block_size=0` gives the per-channel / per-token scheme above.

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

from firstlight.quant.base import QuantizedModule, flatten_tokens, resolve_compute_dtype
from firstlight.quant.registry import QuantFormat, QuantizationError, register_format, unsupported

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448.0
SCALINGS = ("channel", "tensor")  # weights
ACT_SCALINGS = ("token", "tensor")  # activations (dynamic)
KERNELS = ("emulate", "scaled_mm")


def fp8_scales(x: torch.Tensor, per_row: bool) -> torch.Tensor:
    """amax / 448: fp32 [M, 1] if per_row else [1, 1]."""
    x32 = x.float()
    amax = x32.abs().amax(dim=-1, keepdim=True) if per_row else x32.abs().amax().reshape(1, 1)
    return (amax / FP8_MAX).clamp(min=1e-12)


def quantize_fp8(x: torch.Tensor, per_row: bool, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x8 [M, K] float8_e4m3fn, scale fp32 [M, 1] if per_row else [1, 1])."""
    scale = fp8_scales(x, per_row) if scale is None else scale.float()
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


BLOCK_SIZES = (0, 32, 64, 128)  # 0: per-channel / per-token scales, no blocks
DEFAULT_BLOCK_SIZE = 32


def quantize_fp8_blocks(x: torch.Tensor, block: int, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x8 [M, K] float8_e4m3fn, scale fp32 [M, K/block]): one scale per row and block."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // block, block)
    scale = (blocks.abs().amax(dim=-1) / FP8_MAX).clamp(min=1e-12) if scale is None else scale.float()
    x8 = (blocks / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return x8.reshape(m, k), scale


def dequantize_fp8_blocks(x8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    m, k = x8.shape
    nb = scale.shape[1]
    return (x8.to(dtype).reshape(m, nb, k // nb) * scale.to(dtype)[..., None]).reshape(m, k)


class FP8Grid:
    """The E4M3 grid for GPTQ: one scale per output channel (or per tensor) fitted on the whole
    weight, or with group_size, one per row and block of input channels (fitted as GPTQ reaches it)."""

    def __init__(self, per_row: bool = True, group_size: int | None = None) -> None:
        self.per_row, self.group_size = per_row, group_size

    def fit(self, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        s = fp8_scales(w, self.per_row)  # [N, 1] | [1, 1]
        return (s.expand(w.shape[0], 1).reshape(-1).contiguous(),)

    def round(self, w: torch.Tensor, params: tuple[torch.Tensor, ...]) -> torch.Tensor:
        s = params[0][:, None]
        return (w / s).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * s


class FP8Linear(QuantizedModule):
    def __init__(
        self, linear: nn.Linear, weight_scaling: str, act_scaling: str, kernel: str,
        compute_dtype: torch.dtype, kernel_name: str, params: tuple[torch.Tensor, ...] | None = None,
        block_size: int = 0,
    ) -> None:
        """params: (scale [N] or [N, K/B],) from a calibrated method (GPTQ, whose weights lie on that grid)."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.act_per_token = act_scaling == "token"
        self.use_scaled_mm = kernel == "scaled_mm"
        self.compute_dtype, self.kernel, self.block_size = compute_dtype, kernel_name, block_size
        if block_size:
            w8, w_scale = quantize_fp8_blocks(linear.weight.detach(), block_size, None if params is None else params[0])
            self.register_buffer("weight_fp8", w8)  # [N, K]
            self.register_buffer("weight_scale", w_scale.contiguous())  # [N, K/B]
        else:
            per_row = weight_scaling == "channel"
            given = None if params is None else (params[0][:, None] if per_row else params[0][:1].reshape(1, 1))
            w8, w_scale = quantize_fp8(linear.weight.detach(), per_row, given)
            self.register_buffer("weight_fp8", w8)  # [N, K]
            self.register_buffer("weight_scale", w_scale.t().contiguous())  # [1, N] or [1, 1]
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = flatten_tokens(x, torch.float32)  # [M, K]
        if self.block_size:
            # Emulation: each operand dequantized block by block, then one matmul; equal to the sum of
            # scaled per-block fp8 products up to the order of the fp accumulation.
            x8, x_scale = quantize_fp8_blocks(x2, self.block_size)  # [M, K], [M, K/B]
            xq = dequantize_fp8_blocks(x8, x_scale, self.compute_dtype)
            y = F.linear(xq, dequantize_fp8_blocks(self.weight_fp8, self.weight_scale, self.compute_dtype))
            y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
            return y if self.bias is None else y + self.bias
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
        if self.block_size:
            return dequantize_fp8_blocks(self.weight_fp8, self.weight_scale, torch.float32)
        return self.weight_fp8.float() * self.weight_scale.t()

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, fp8 e4m3, {self.kernel}"


@register_format
class FP8E4M3(QuantFormat):
    name = "fp8"
    summary = "FP8 E4M3 weights and activations, scaled per block of 32 channels and clamped; emulated matmul"

    def __init__(
        self, weight_scaling: str = "channel", act_scaling: str = "token", kernel: str = "emulate",
        compute_dtype: str = "auto", block_size: int | None = None, **opts: Any,
    ) -> None:
        super().__init__(**opts)
        if block_size is None:  # default: blocks of 32 where the kernel takes them (measured best, docs/QUANT.md)
            block_size = DEFAULT_BLOCK_SIZE if kernel == "emulate" else 0
        if block_size not in BLOCK_SIZES:
            raise QuantizationError(f"fp8 block_size must be one of {BLOCK_SIZES} (0 = per channel/token), got {block_size}")
        if block_size and kernel == "scaled_mm":
            raise QuantizationError("fp8 block_size needs kernel='emulate': the block-scaled FP8 GEMM is not wired here")
        self.block_size = block_size
        for value, allowed, what in ((weight_scaling, SCALINGS, "weight_scaling"),
                                     (act_scaling, ACT_SCALINGS, "act_scaling"), (kernel, KERNELS, "kernel")):
            if value not in allowed:
                raise QuantizationError(f"fp8 {what} must be one of {allowed}, got '{value}'")
        self.weight_scaling, self.act_scaling, self.kernel = weight_scaling, act_scaling, kernel
        self.compute_dtype = compute_dtype

    def kernel_path(self, device: torch.device, dtype: torch.dtype) -> str:
        cdt = resolve_compute_dtype(self.compute_dtype, device, dtype, dtype)
        scaling = f"w per-{self.weight_scaling}, x per-{self.act_scaling}"
        if self.block_size:
            scaling = f"w per-(channel, {self.block_size} inputs), x per-(token, {self.block_size} channels)"
        if self.kernel == "emulate":
            return f"emulated: float8_e4m3fn round-trip + F.linear in {str(cdt).removeprefix('torch.')} ({scaling})"
        if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
            raise unsupported(self.name, device, dtype, "torch._scaled_mm needs compute capability 8.9+ (use kernel='emulate')")
        if device.type not in ("cpu", "cuda"):
            raise unsupported(self.name, device, dtype, "torch._scaled_mm runs on CPU and CUDA only (use kernel='emulate')")
        return f"torch._scaled_mm ({device.type}, {scaling})"

    def check_linear(self, linear: nn.Linear) -> None:
        if self.block_size and linear.in_features % self.block_size:
            raise QuantizationError(f"fp8: in_features {linear.in_features} is not a multiple of block_size {self.block_size}")

    def grid(self, device: torch.device, dtype: torch.dtype) -> FP8Grid:
        return FP8Grid(per_row=self.weight_scaling == "channel", group_size=self.block_size or None)

    def quantize_linear(self, linear: nn.Linear, params: tuple[torch.Tensor, ...] | None = None) -> nn.Module:
        device, dtype = linear.weight.device, linear.weight.dtype
        kernel_name = self.kernel_path(device, dtype)
        cdt = resolve_compute_dtype(self.compute_dtype, device, dtype, dtype)
        if linear.weight.ndim != 2:
            raise QuantizationError(f"fp8: expected a 2-D weight, got {tuple(linear.weight.shape)}")
        self.check_linear(linear)
        return FP8Linear(linear, self.weight_scaling, self.act_scaling, self.kernel, cdt, kernel_name, params,
                         self.block_size)
