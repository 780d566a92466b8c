"""Quantize a whole model: swap its nn.Linear (and optionally nn.Embedding) modules for quantized
ones, in place, and report what changed and the weight bytes before and after.

    report = quantize_model(model, "int8")           # or "int4", "fp8", with format options
    print(report.summary())

Every layer is checked before any is replaced, so an unsupported device, dtype or shape raises a
QuantizationError and leaves the model as it was.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from firstlight.engine.quant.base import QuantizedModule
from firstlight.engine.quant.int8 import Int8Embedding, Int8WeightOnlyLinear
from firstlight.engine.quant.registry import QuantFormat, QuantizationError, get_format

NO_QUANTIZATION = ("none", "", None)


@dataclass
class QuantizedLayer:
    name: str
    kind: str  # "linear" | "embedding"
    shape: tuple[int, ...]
    kernel: str
    bytes_before: int
    bytes_after: int


@dataclass
class QuantReport:
    format: str
    device: str
    dtype: str
    kernel: str  # the matmul kernel of this format on this device
    layers: list[QuantizedLayer] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    weight_bytes_before: int = 0
    weight_bytes_after: int = 0

    @property
    def compression(self) -> float:
        return self.weight_bytes_before / self.weight_bytes_after if self.weight_bytes_after else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "compression": self.compression}

    def summary(self) -> str:
        mib = 1 << 20
        return (
            f"{self.format}: {len(self.layers)} layers quantized, {len(self.skipped)} kept "
            f"({', '.join(self.skipped) or 'none'}); weights {self.weight_bytes_before / mib:.1f} MiB -> "
            f"{self.weight_bytes_after / mib:.1f} MiB ({self.compression:.2f}x); kernel: {self.kernel}"
        )


def model_weight_bytes(model: nn.Module) -> int:
    """Bytes of all parameters and buffers, each storage counted once (tied weights are shared)."""
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            continue
        seen.add(ptr)
        total += t.untyped_storage().nbytes()
    return total


def _tensor_bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def quantize_model(
    model: nn.Module,
    fmt: str | QuantFormat,
    *,
    skip_lm_head: bool = False,
    skip_embeddings: bool = False,
    skip: tuple[str, ...] = (),
    **opts: Any,
) -> QuantReport:
    """Quantize `model` in place with format `fmt` (a name from list_formats(), with `opts`).

    skip_lm_head keeps the output projection in the model's dtype; skip_embeddings keeps the token
    embedding (otherwise stored as int8 rows with a per-row scale, shared with a tied int8 lm_head);
    skip holds further module names to keep.
    """
    qfmt = get_format(fmt, **opts) if isinstance(fmt, str) else fmt
    if any(isinstance(m, QuantizedModule) for m in model.modules()):
        raise QuantizationError("this model is already quantized; load it again to quantize it another way")
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    kernel = qfmt.kernel_path(device, dtype)  # raises if the device has no kernel for this format

    lm_head = getattr(model, "lm_head", None)
    kept = set(skip) | ({"lm_head"} if skip_lm_head else set())
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in kept}
    embeddings = {} if skip_embeddings else {n: m for n, m in model.named_modules() if isinstance(m, nn.Embedding)}
    for name, linear in linears.items():
        try:
            qfmt.check_linear(linear)
        except QuantizationError as e:
            raise QuantizationError(f"layer '{name}' {tuple(linear.weight.shape)}: {e}") from e

    report = QuantReport(qfmt.name, str(device), str(dtype).removeprefix("torch."), kernel)
    report.weight_bytes_before = model_weight_bytes(model)
    report.skipped = sorted(n for n, m in model.named_modules() if isinstance(m, nn.Linear | nn.Embedding)
                            and n not in linears and n not in embeddings)
    with torch.no_grad():
        replaced: dict[str, nn.Module] = {}
        for name, linear in linears.items():
            q = qfmt.quantize_linear(linear)
            replaced[name] = q
            report.layers.append(QuantizedLayer(name, "linear", tuple(linear.weight.shape), q.kernel,
                                                _tensor_bytes(linear), _tensor_bytes(q)))
        for name, emb in embeddings.items():
            head = replaced.get("lm_head")
            if lm_head is not None and lm_head.weight is emb.weight and isinstance(head, Int8WeightOnlyLinear):
                # Tied int8 head: the embedding reads the head's own codes and scales (no second copy).
                q = Int8Embedding(head.qweight, head.scales, emb.weight.dtype)
            else:
                q = Int8Embedding.from_embedding(emb)
            replaced[name] = q
            report.layers.append(QuantizedLayer(name, "embedding", tuple(emb.weight.shape), q.kernel,
                                                _tensor_bytes(emb), _tensor_bytes(q)))
        for name, module in replaced.items():
            _set_module(model, name, module)
    report.weight_bytes_after = model_weight_bytes(model)
    return report


def apply_quantization(model: nn.Module, fmt: str | None, **opts: Any) -> QuantReport | None:
    """The hook for `generate` / `serve` / `verify --quantization FMT`: None or 'none' is a no-op."""
    if fmt in NO_QUANTIZATION:
        return None
    return quantize_model(model, fmt, **opts)
