"""The quantization formats, found by name: one module per format, each registering itself here.

A format turns one `nn.Linear` into a module with the same call signature that stores its weight
in fewer bytes. Before it touches a model it says which kernel will run on the model's device and
dtype (`kernel_path`), or raises `QuantizationError` when it has none there: a format never falls
back silently to another computation than the one it names.
"""

from __future__ import annotations

import importlib
from typing import Any, ClassVar

import torch
from torch import nn

from firstlight.errors import FirstlightError

# Modules that define (and register) the built-in formats; imported on first lookup.
_FORMAT_MODULES = ("firstlight.quant.int8", "firstlight.quant.int4", "firstlight.quant.w4a8", "firstlight.quant.fp8", "firstlight.quant.w8a8")
_FORMATS: dict[str, type[QuantFormat]] = {}


class QuantizationError(FirstlightError):
    """A quantization format that does not exist, or cannot run on this device, dtype or shape."""


class QuantFormat:
    """One weight format. Subclasses set `name`, `summary` and implement the three methods."""

    name: ClassVar[str]
    summary: ClassVar[str]
    # lm_head="auto" on a tied head: int8 weight-only, sharing the embedding's int8 codes (see quant/model.py)
    int8_tied_head: ClassVar[bool] = True

    def __init__(self, **opts: Any) -> None:
        if opts:
            raise QuantizationError(f"format '{self.name}' takes no options {sorted(opts)}")

    def kernel_path(self, device: torch.device, dtype: torch.dtype) -> str:
        """The kernel that runs the matmul on (device, dtype); QuantizationError if there is none."""
        raise NotImplementedError

    def check_linear(self, linear: nn.Linear) -> None:
        """Raise QuantizationError if this layer's shape cannot be stored in this format."""

    def quantize_linear(self, linear: nn.Linear, params: tuple[torch.Tensor, ...] | None = None) -> nn.Module:
        """The quantized layer; `params` are grid parameters chosen by a calibrated method (GPTQ)."""
        raise NotImplementedError

    def exact_channels(self, hessian: torch.Tensor) -> torch.Tensor | None:
        """Input channels a calibrated method keeps out of the grid (exact), chosen from the layer's
        calibration Hessian; they reach `quantize_linear` as the last of `params`. None: none."""
        return None

    def grid(self, device: torch.device, dtype: torch.dtype) -> Any:
        """The rounding grid GPTQ works on (gptq.Grid); formats without one cannot be calibrated."""
        raise QuantizationError(f"format '{self.name}' has no grid for calibrated methods; use method 'rtn'")


def register_format(cls: type[QuantFormat]) -> type[QuantFormat]:
    """Class decorator: make a format available by its `name`."""
    _FORMATS[cls.name] = cls
    return cls


def _load_builtin() -> None:
    for module in _FORMAT_MODULES:
        importlib.import_module(module)


def list_formats() -> dict[str, str]:
    """name -> one-line summary of every registered format."""
    _load_builtin()
    return {name: cls.summary for name, cls in sorted(_FORMATS.items())}


def get_format(name: str, **opts: Any) -> QuantFormat:
    """An instance of the format called `name`, configured with `opts`."""
    _load_builtin()
    if name not in _FORMATS:
        raise QuantizationError(
            f"unknown quantization format '{name}'; use one of: {', '.join(sorted(_FORMATS))} (or 'none')"
        )
    return _FORMATS[name](**opts)


def device_kind(device: torch.device | str) -> str:
    return torch.device(device).type


def unsupported(fmt: str, device: torch.device, dtype: torch.dtype, why: str) -> QuantizationError:
    return QuantizationError(
        f"quantization format '{fmt}' is not supported on {device} with {str(dtype).removeprefix('torch.')} "
        f"weights: {why}"
    )
