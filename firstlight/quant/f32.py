"""fp32 linears on CPU through firstlight's own small-batch matmul (`firstlight::f32_mm`,
kernels/csrc/f32_gemm.cpp) for decode-sized batches, the BLAS above.

Not a quantization: the weights stay the model's own fp32 tensors (shared, so a tied LM head stays tied and
state_dict keys do not change); only the matmul that multiplies them changes, and only its summation order.
Why: at 2..32 activation rows the BLAS packs every weight on every call (docs/PERFORMANCE.md, "fp32 at
decode-sized batches").
The serving engine's loader applies it (engine/llm.py `load`); FIRSTLIGHT_CPU_KERNELS=aten turns it off with
the other kernels of the extension.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from firstlight import kernels


class F32Linear(nn.Linear):
    """nn.Linear whose fp32 CPU products go through firstlight::f32_mm (the BLAS above its row limit); with
    autograd recording (a tensor that requires grad), torch's F.linear."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.device.type != "cpu" or (
                torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)):
            return F.linear(x, self.weight, self.bias)  # the op has no backward: autograd keeps torch's
        y = kernels.f32_mm(x.reshape(-1, x.shape[-1]), self.weight, self.bias)
        return y.reshape(*x.shape[:-1], y.shape[-1])


def use_f32_kernel(model: nn.Module) -> int:
    """Route every plain fp32 nn.Linear of a CPU model through firstlight::f32_mm; returns how many.

    Nothing changes (0) when the extension is not in use (FIRSTLIGHT_CPU_KERNELS=aten, or a failed build in
    mode auto, which warns once).
    """
    if kernels.load_kernel() is None:
        return 0
    swapped = 0
    for module in model.modules():
        if (type(module) is nn.Linear and module.weight.dtype == torch.float32
                and module.weight.device.type == "cpu" and module.weight.is_contiguous()):
            module.__class__ = F32Linear  # same parameters, same state_dict: only forward changes
            swapped += 1
    return swapped
