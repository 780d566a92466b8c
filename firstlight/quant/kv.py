"""Quantized KV cache: K and V stored as int8 or FP8 E4M3 with one fp32 scale per (token, head),
dequantized when attention reads them; or as a 16-bit float (bf16, fp16: rounded to nearest, no scale), the
storage llama.cpp's server uses by default (`-ctk f16`) under an fp32 model.

The scale covers the D values of one head of one token, so a token's entry never changes once
written and needs no calibration: a paged cache stores `q` in its blocks and `scale` in a parallel
[num_blocks, block_size, Hkv, 1] tensor, calling the same `quantize_kv` on write and
`dequantize_kv` on the gathered slots (see QuantizedKVCache for the contiguous layout).

Bytes per cached element: 1 + 4/D (int8 or fp8 code + its share of the scale), vs 4 in fp32 and
2 in bf16; at D = 64, 1.0625 bytes.
"""

from __future__ import annotations

import torch

from firstlight.models.kv_cache import ContiguousKVCache, KVCache
from firstlight.quant.registry import QuantizationError

# name -> (storage dtype, largest code magnitude)
KV_FORMATS: dict[str, tuple[torch.dtype, float]] = {
    "int8": (torch.int8, 127.0),
    "fp8": (torch.float8_e4m3fn, float(torch.finfo(torch.float8_e4m3fn).max)),
}


# name -> storage dtype of the 16-bit float formats: a value rounded to the nearest as torch's `.to()` rounds it,
# widened back to the model's dtype as attention reads it; 2 bytes per cached element
KV_CAST_FORMATS: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}


def check_kv_format(name: str) -> None:
    """Raise, naming the choices, unless `name` is a KV-cache format (scaled or 16-bit float)."""
    if name not in KV_FORMATS and name not in KV_CAST_FORMATS:
        choices = ", ".join((*KV_FORMATS, *KV_CAST_FORMATS))
        raise QuantizationError(f"KV-cache format '{name}' is not one of: {choices} (or 'none')")


def kv_format(name: str) -> tuple[torch.dtype, float]:
    """(code dtype, largest code magnitude) of a scaled format."""
    if name not in KV_FORMATS:
        check_kv_format(name)  # an unknown name: the error names every format
        raise QuantizationError(f"KV-cache format '{name}' has no scale; its storage is {KV_CAST_FORMATS[name]}")
    return KV_FORMATS[name]


def quantize_kv(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (codes [..., D] in the format's dtype, scale [..., 1] fp32), symmetric."""
    dtype, qmax = kv_format(fmt)
    x32 = x.float()
    scale = (x32.abs().amax(dim=-1, keepdim=True) / qmax).clamp(min=1e-12)
    y = (x32 / scale).clamp(-qmax, qmax)
    if dtype == torch.int8:
        y = torch.round(y)
    return y.to(dtype), scale


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes [..., D], scale [..., 1] -> values [..., D] in `dtype`."""
    return (q.float() * scale).to(dtype)


class QuantizedKVCache(ContiguousKVCache):
    """The ContiguousKVCache contract (begin / update / end, firstlight/models/kv_cache.py) with
    K/V held as int8 or FP8 codes + per-(token, head) scales; `update` returns dequantized keys and
    values in `dtype`, so the model's attention is unchanged."""

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        fmt: str = "int8",
    ) -> None:
        code_dtype, _ = kv_format(fmt)
        # self.k / self.v hold the codes: [B, Hkv, max_len, D]
        super().__init__(num_layers, batch_size, num_kv_heads, head_dim, max_len, code_dtype, device)
        scale_shape = (batch_size, num_kv_heads, max_len, 1)
        self.k_scale = [torch.zeros(scale_shape, device=device) for _ in range(num_layers)]
        self.v_scale = [torch.zeros(scale_shape, device=device) for _ in range(num_layers)]
        self.fmt, self.dtype = fmt, dtype

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = self.length, self.length + self._new
        for codes, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            q, s = quantize_kv(x, self.fmt)  # [B, Hkv, S, D], [B, Hkv, S, 1]
            codes[layer][:, :, start:end] = q
            scales[layer][:, :, start:end] = s
        k_all = dequantize_kv(self.k[layer][:, :, :end], self.k_scale[layer][:, :, :end], self.dtype)
        v_all = dequantize_kv(self.v[layer][:, :, :end], self.v_scale[layer][:, :, :end], self.dtype)
        return k_all, v_all

    def storage_bytes(self) -> int:
        tensors = self.k + self.v + self.k_scale + self.v_scale
        return sum(t.numel() * t.element_size() for t in tensors)


class CastKVCache(ContiguousKVCache):
    """A ContiguousKVCache whose storage dtype (a 16-bit float of KV_CAST_FORMATS) is not the model's: `update`
    returns K/V widened back to the dtype they came in, so the model's attention is unchanged."""

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k_all, v_all = super().update(layer, k, v)  # the slice assignment rounds to the storage dtype
        return k_all.to(k.dtype), v_all.to(v.dtype)


def make_kv_cache(
    kv_quantization: str | None,
    num_layers: int,
    batch_size: int,
    num_kv_heads: int,
    head_dim: int,
    max_len: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> KVCache:
    """A contiguous cache for `generate`: plain when kv_quantization is None/'none', else quantized (scaled
    codes) or stored as a 16-bit float."""
    if kv_quantization in (None, "none"):
        return ContiguousKVCache(num_layers, batch_size, num_kv_heads, head_dim, max_len, dtype, device)
    if kv_quantization in KV_CAST_FORMATS:
        storage = KV_CAST_FORMATS[kv_quantization]
        return CastKVCache(num_layers, batch_size, num_kv_heads, head_dim, max_len, storage, device)
    return QuantizedKVCache(num_layers, batch_size, num_kv_heads, head_dim, max_len, dtype, device, kv_quantization)
