"""What every quantized layer shares: a dequantized view of its weight (for tests and references),
the bytes it stores, and the name of the kernel it runs."""

from __future__ import annotations

import torch
from torch import nn

from firstlight.quant.registry import QuantizationError

COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class QuantizedModule(nn.Module):
    """Base of the quantized replacements of nn.Linear / nn.Embedding."""

    kernel: str = ""

    def dequantized_weight(self) -> torch.Tensor:
        """The weight [N, K] this layer effectively multiplies by, in fp32."""
        raise NotImplementedError

    def opaque_bytes(self) -> int:
        """Weight bytes held outside tensors (a kernel's prepacked weight object)."""
        return 0

    def storage_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers()) + self.opaque_bytes()


def resolve_compute_dtype(name: str, device: torch.device, model_dtype: torch.dtype, cpu_default: torch.dtype) -> torch.dtype:
    """'auto' -> `cpu_default` on CPU, the model's dtype elsewhere; else the named dtype."""
    if name == "auto":
        return cpu_default if device.type == "cpu" else model_dtype
    if name not in COMPUTE_DTYPES:
        raise QuantizationError(f"compute_dtype '{name}' is not one of: auto, {', '.join(COMPUTE_DTYPES)}")
    return COMPUTE_DTYPES[name]


def flatten_tokens(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [..., K] -> contiguous [M, K] in `dtype` (the packed kernels take 2-D activations); x itself when it is
    that already (a decode step's rows: three no-op dispatches saved per linear)."""
    if x.dim() == 2 and x.dtype == dtype and x.is_contiguous():
        return x
    return x.reshape(-1, x.shape[-1]).to(dtype).contiguous()
