"""w4a8: int4 weights (exactly the int4 format's codes, scales and zeros) x int8 activations rounded per
block of 32 input channels, integer dot products (llama.cpp's Q4_1 x Q8_1 scheme).

Each call rounds every activation row once, per block b of 32 channels: x^ = dx_b * round(x * 127 / max|x_b|),
dx_b = max|x_b| / 127, and `firstlight::int4_mm_a8` returns W~ x^ (W~ the int4 weight) up to fp32 summation:
per weight block an int32 dot product of the unsigned 4-bit codes with the int8 activations (AVX2
maddubs + madd per row; with the weights repacked at load by kernels.pack_int4_vnni, 16 rows per tile: one
vpdpbusd per 4 channels of 16 rows on AVX-512 VNNI, maddubs + madd on AVX2), scaled by d * dx_b, plus each group's zero term m * sum(x^). The error this adds to the
int4 format's is at most sum_k |W~[n, k]| * dx_b / 2 per output (the rounding of x^). CPU, firstlight's
kernel only (no aten or CUDA kernel takes this layout): FIRSTLIGHT_CPU_KERNELS=aten makes it an error.
"""

from __future__ import annotations

import torch

from firstlight import kernels
from firstlight.quant.int4 import Int4WeightOnly
from firstlight.quant.registry import register_format, unsupported


@register_format
class Int4WeightInt8Act(Int4WeightOnly):
    name = "w4a8"
    summary = "int4 weights per group (as int4) x int8 activations per block of 32, integer dot (firstlight CPU kernel)"
    activations = "int8"

    def kernel_path(self, device: torch.device, dtype: torch.dtype) -> str:
        if device.type != "cpu":
            raise unsupported(self.name, device, dtype, "the int4 x int8 kernel exists for CPU only; use int4")
        isa = kernels.load_kernel()
        if isa is None:
            raise unsupported(self.name, device, dtype, f"firstlight's int4 kernel is not in use "
                              f"({kernels.ENV}={kernels.kernel_mode()}, or it did not build); use int4")
        layout = {"avx512vnni": ", 16 rows per vpdpbusd (rows a multiple of 16)",
                  "avx2": ", 16 rows per maddubs tile (rows a multiple of 16)"}.get(isa, "")
        return f"firstlight::int4_mm_a8 ({isa}, group {self.group_size}, int8 activations per block of 32{layout})"

    def buffer_layout(self, device: torch.device) -> str:
        return "firstlight-int4-vnni-v1" if kernels.load_kernel() in kernels.TILED_ISAS else "firstlight-int4-v1"
