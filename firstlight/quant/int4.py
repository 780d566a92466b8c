"""int4 weight-only, asymmetric per group of `group_size` input channels (the "tinygemm" layout of
gpt-fast and torchao `int4_weight_only`).

For output row n and group g (input channels g*G .. g*G+G-1), with lo/hi the group's min/max:

    scale[g, n] = (hi - lo) / 15
    zero[g, n]  = lo + 8 * scale[g, n]                      (the value that code 8 stands for)
    Q[n, k]     = clamp(round((W[n, k] - lo) / scale), 0, 15)
    W~[n, k]    = (Q[n, k] - 8) * scale[g, n] + zero[g, n]

Kernels: CPU, by default firstlight's own `firstlight::int4_mm` (kernels/csrc/int4_gemv.cpp, built at
first use, see firstlight/kernels/__init__.py): the same codes, scales and zeros, packed as 16-byte blocks of 32
channels with fp32 d = scale, m = zero - 8 * scale per group; activations stay fp32. If it cannot be
built (or FIRSTLIGHT_CPU_KERNELS=aten): `aten._convert_weight_to_int4pack_for_cpu(Q int32 [N, K], 1)`
packs two codes per byte, `aten._weight_int4pack_mm_for_cpu(x, packed, G, scales_and_zeros [K/G, N, 2])`
multiplies; as for int8, its vectorized CPU path is the bf16 one, so activations enter in bfloat16.
The scales and zeros are rounded to the compute dtype (bf16 on CPU by default) either way, so both
kernels use one quantization grid.
CUDA: `aten._convert_weight_to_int4pack(uint8 [N, K/2], inner_k_tiles)` + `aten._weight_int4pack_mm`
(tinygemm, bfloat16 only, sm80+). Not exercised in this repository's CPU test runs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from firstlight import kernels
from firstlight.quant.base import QuantizedModule, flatten_tokens, resolve_compute_dtype
from firstlight.quant.registry import QuantFormat, QuantizationError, register_format, unsupported

GROUP_SIZES = (32, 64, 128, 256)  # what both aten kernels accept
N_MULTIPLE = 16  # aten's CPU packing needs N % 16 == 0 (firstlight's kernel does not)


CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)


def fit_int4_groups(
    groups: torch.Tensor, clip_search: bool = False, param_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """groups [..., G] -> (scale, zero) [...] fp32, each rounded to `param_dtype`, the dtype the kernel
    stores them in (bf16 on CPU): codes are then chosen against the values the kernel really uses.

    scale = (hi - lo) / 15 and zero = lo + 8 * scale (the value code 8 stands for). With clip_search,
    the range [lo, hi] is shrunk by the ratio in CLIP_RATIOS that gives the least squared error (the
    data-free form of AWQ's clip search, Lin et al. 2024).
    """
    lo0, hi0 = groups.amin(dim=-1), groups.amax(dim=-1)
    best = None
    for ratio in CLIP_RATIOS if clip_search else (1.0,):
        scale = ((hi0 - lo0) * ratio / 15).clamp(min=1e-8).to(param_dtype).float()
        zero = (lo0 * ratio + 8 * scale).to(param_dtype).float()
        err = ((round_int4(groups, scale[..., None], zero[..., None]) - groups) ** 2).sum(-1)
        if best is None:
            best = (err, scale, zero)
        else:
            better = err < best[0]
            best = tuple(torch.where(better, new, old) for new, old in zip((err, scale, zero), best, strict=True))
    return best[1], best[2]


def int4_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Nearest code 0..15 of w under W~ = (Q - 8) * scale + zero (scale, zero broadcast to w)."""
    return (torch.round((w - zero) / scale) + 8).clamp(0, 15)


def round_int4(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return (int4_codes(w, scale, zero) - 8) * scale + zero


class Int4GroupGrid:
    """The int4 grid for GPTQ: scale and zero per group of `group_size` input channels per row."""

    def __init__(self, group_size: int, param_dtype: torch.dtype = torch.float32, clip_search: bool = False) -> None:
        self.group_size, self.param_dtype, self.clip_search = group_size, param_dtype, clip_search

    def fit(self, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return fit_int4_groups(w, self.clip_search, self.param_dtype)  # each [N]

    def round(self, w: torch.Tensor, params: tuple[torch.Tensor, ...]) -> torch.Tensor:
        scale, zero = params
        return round_int4(w, scale[:, None], zero[:, None])


def quantize_groupwise_int4(
    w: torch.Tensor, group_size: int, clip_search: bool = False, param_dtype: torch.dtype = torch.float32,
    params: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> (Q [N, K] int32 in 0..15, scale [K/G, N], zero [K/G, N]) in fp32.

    params: (scale, zero) each [N, K/G], given by a calibrated method (GPTQ); else fitted per group
    by min/max (see fit_int4_groups). On SmolLM2-135M, whose weights come from a Q4_1 GGUF (blocks of
    32 input channels, w = d * q + m), min/max in groups of 32 finds each block's own grid again.
    """
    n, k = w.shape
    groups = w.detach().float().reshape(n, k // group_size, group_size)  # [N, K/G, G]
    scale, zero = fit_int4_groups(groups, clip_search, param_dtype) if params is None else params  # [N, K/G]
    q = int4_codes(groups, scale[..., None], zero[..., None]).to(torch.int32)
    return q.reshape(n, k), scale.t().contiguous(), zero.t().contiguous()


def dequantize_groupwise_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> torch.Tensor:
    """Inverse of quantize_groupwise_int4: [N, K] fp32."""
    n, k = q.shape
    groups = q.reshape(n, k // group_size, group_size).float() - 8
    return (groups * scale.t()[..., None] + zero.t()[..., None]).reshape(n, k)


def vnni_layout(out_features: int) -> bool:
    """Whether a w4a8 linear of this many rows takes the tiled (VNNI) layout (kernels.pack_int4_vnni): with our
    AVX-512 VNNI or AVX2 kernel (vpdpbusd, or maddubs + madd, per 16 rows), not the scalar build."""
    return kernels.load_kernel() in kernels.TILED_ISAS and out_features % kernels.VNNI_TILE == 0


def _inner_k_tiles(k: int) -> int:
    """Largest tinygemm tiling (8, 4 or 2 tiles of 16) that divides K, for the CUDA packing."""
    for tiles in (8, 4, 2):
        if k % (tiles * 16) == 0:
            return tiles
    raise QuantizationError(f"int4 on CUDA needs in_features divisible by 32, got {k}")


class Int4WeightOnlyLinear(QuantizedModule):
    def __init__(
        self, linear: nn.Linear, group_size: int, compute_dtype: torch.dtype, kernel: str, clip_search: bool = False,
        params: tuple[torch.Tensor, torch.Tensor] | None = None, activations: str = "float",
    ) -> None:
        """params: (scale, zero) each [N, K/G] from a calibrated method (GPTQ). activations: "float", or
        "int8" (rounded per block of 32, integer dot products: firstlight's CPU kernel only)."""
        super().__init__()
        self.activations = activations
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.group_size, self.compute_dtype, self.kernel = group_size, compute_dtype, kernel
        q, scale, zero = quantize_groupwise_int4(linear.weight, group_size, clip_search, compute_dtype, params)
        self.on_cuda = linear.weight.device.type == "cuda"
        # firstlight's kernel on CPU when it is built (kernel_path decided which; the same test here)
        self.ours = not self.on_cuda and kernels.load_kernel() is not None
        if activations == "int8" and not self.ours:
            raise QuantizationError("int4 with int8 activations needs firstlight's CPU int4 kernel (w4a8)")
        if self.ours:
            packed, d, m = kernels.pack_int4(q, scale, zero, group_size)
            if activations == "int8" and vnni_layout(self.out_features):  # the same codes, 16 rows per register
                packed, d, m = kernels.pack_int4_vnni(packed, d, m)
            self.register_buffer("packed", packed)  # uint8 [N, K/2] (VNNI: [N/16, K/8, 64])
            self.register_buffer("scales", d)  # fp32 [N, K/G] (VNNI: [N/16, K/G, 16])
            self.register_buffer("mins", m)  # fp32 [N, K/G] (VNNI: [N/16, K/G, 16])
        else:
            if self.on_cuda:
                packed_bytes = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)  # [N, K/2]
                packed = torch.ops.aten._convert_weight_to_int4pack(packed_bytes, _inner_k_tiles(self.in_features))
            else:
                packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
            self.register_buffer("packed", packed)
            self.register_buffer("scales_and_zeros", torch.stack([scale, zero], dim=-1).to(compute_dtype))  # [K/G, N, 2]
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ours:
            x2 = flatten_tokens(x, torch.float32)  # [M, K]
            mm = kernels.int4_mm_a8 if self.activations == "int8" else kernels.int4_mm
            y = mm(x2, self.packed, self.scales, self.mins, self.group_size)
        else:
            x2 = flatten_tokens(x, self.compute_dtype)  # [M, K]
            if self.on_cuda:
                y = torch.ops.aten._weight_int4pack_mm(x2, self.packed, self.group_size, self.scales_and_zeros)
            else:
                y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group_size, self.scales_and_zeros)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)  # [..., N]
        return y if self.bias is None else y + self.bias

    def dequantized_weight(self) -> torch.Tensor:
        if self.ours:  # the kernel's own fma(q, d, m) per weight
            return kernels.int4_dequant(self.packed, self.scales, self.mins, self.group_size)
        # Run the kernel on the identity: row k of the result is W~[:, k], exactly as the kernel sees it.
        eye = torch.eye(self.in_features, dtype=self.compute_dtype, device=self.packed.device)
        if self.on_cuda:
            cols = torch.ops.aten._weight_int4pack_mm(eye, self.packed, self.group_size, self.scales_and_zeros)
        else:
            cols = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, self.group_size, self.scales_and_zeros)
        return cols.float().t().contiguous()  # [N, K]

    def extra_repr(self) -> str:
        acts = ", int8 activations" if self.activations == "int8" else ""
        return f"{self.in_features} -> {self.out_features}, int4 group {self.group_size}{acts}, {self.kernel}"


@register_format
class Int4WeightOnly(QuantFormat):
    name = "int4"
    summary = "int4 weights, asymmetric per group of input channels; activations unquantized (firstlight or aten int4 mm)"

    activations = "float"  # w4a8 (quant/w4a8.py): "int8"

    def __init__(self, group_size: int = 32, compute_dtype: str = "auto", clip_search: bool = False, **opts: Any) -> None:
        super().__init__(**opts)
        self.clip_search = clip_search
        if group_size not in GROUP_SIZES:
            raise QuantizationError(f"int4 group_size must be one of {GROUP_SIZES}, got {group_size}")
        self.group_size, self.compute_dtype = group_size, compute_dtype

    def kernel_path(self, device: torch.device, dtype: torch.dtype) -> str:
        cdt = resolve_compute_dtype(self.compute_dtype, device, dtype, torch.bfloat16)
        if device.type == "cpu":
            isa = kernels.load_kernel()
            if isa is not None:
                return f"firstlight::int4_mm ({isa}, group {self.group_size}, float32 activations)"
            return f"aten._weight_int4pack_mm_for_cpu (group {self.group_size}, {str(cdt).removeprefix('torch.')} activations)"
        if device.type == "cuda":
            if cdt != torch.bfloat16:
                raise unsupported(self.name, device, dtype, "the CUDA tinygemm kernel takes bfloat16 only: load the model with --dtype bfloat16")
            if torch.cuda.get_device_capability(device) < (8, 0):
                raise unsupported(self.name, device, dtype, "aten._weight_int4pack_mm needs compute capability 8.0+")
            return f"aten._weight_int4pack_mm (tinygemm, group {self.group_size}, bfloat16)"
        raise unsupported(self.name, device, dtype, "the int4 packed kernels exist for CPU and CUDA only")

    def buffer_layout(self, device: torch.device) -> str:
        """'' for aten's packing (the layout GPTQ caches were keyed without), else our kernel's: a cache of
        quantized buffers saved under one layout is not loaded under the other."""
        return "firstlight-int4-v1" if device.type == "cpu" and kernels.load_kernel() is not None else ""

    def check_linear(self, linear: nn.Linear) -> None:
        n, k = linear.out_features, linear.in_features
        if k % self.group_size:
            fits = [g for g in GROUP_SIZES if k % g == 0]
            hint = f"use group_size one of {fits}" if fits else "skip this layer"
            raise QuantizationError(f"int4: in_features {k} is not a multiple of group_size {self.group_size}; {hint}")
        ours = linear.weight.device.type == "cpu" and kernels.load_kernel() is not None
        if n % N_MULTIPLE and not ours:
            raise QuantizationError(f"int4: out_features {n} is not a multiple of {N_MULTIPLE} (packed kernel layout); skip this layer")

    def grid(self, device: torch.device, dtype: torch.dtype) -> Int4GroupGrid:
        cdt = resolve_compute_dtype(self.compute_dtype, device, dtype, torch.bfloat16)
        return Int4GroupGrid(self.group_size, cdt, self.clip_search)

    def quantize_linear(self, linear: nn.Linear, params: tuple[torch.Tensor, ...] | None = None) -> nn.Module:
        device, dtype = linear.weight.device, linear.weight.dtype
        kernel = self.kernel_path(device, dtype)
        self.check_linear(linear)
        cdt = resolve_compute_dtype(self.compute_dtype, device, dtype, torch.bfloat16)
        p = None if params is None else (params[0], params[1])
        return Int4WeightOnlyLinear(linear, self.group_size, cdt, kernel, self.clip_search, p, self.activations)
