"""Quantization: weight formats (int8, int4, fp8, w8a8) registered by name, whole-model quantization with
a report, and a quantized KV cache. See docs/QUANT.md for the kernel each format runs per device."""

from firstlight.quant.kv import (
    KV_FORMATS,
    QuantizedKVCache,
    dequantize_kv,
    make_kv_cache,
    quantize_kv,
)
from firstlight.quant.model import (
    QuantizedLayer,
    QuantReport,
    apply_quantization,
    model_weight_bytes,
    quantize_model,
)
from firstlight.quant.registry import (
    QuantFormat,
    QuantizationError,
    get_format,
    list_formats,
    register_format,
)

__all__ = [
    "KV_FORMATS",
    "QuantFormat",
    "QuantReport",
    "QuantizationError",
    "QuantizedKVCache",
    "QuantizedLayer",
    "apply_quantization",
    "dequantize_kv",
    "get_format",
    "list_formats",
    "make_kv_cache",
    "model_weight_bytes",
    "quantize_kv",
    "quantize_model",
    "register_format",
]
