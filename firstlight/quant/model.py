"""Quantize a whole model: swap its nn.Linear (and optionally nn.Embedding) modules for quantized
ones, in place, and report what changed and the weight bytes before and after.

    report = quantize_model(model, "int8")           # or "int4", "fp8", "w8a8", with format options
    report = quantize_model(model, "int8", method="gptq", calibration_ids=ids)   # see gptq.py
    print(report.summary())

Methods: "rtn" rounds every weight to its nearest code; "gptq" (Frantar et al. 2022) uses the
Hessians of each layer's inputs on calibration tokens to choose codes that keep the layer's output
(calibrated.py); the result is cached on disk, keyed by the weights, format and calibration ids.

The output projection: when it is tied to the token embedding (SmolLM2, Qwen2 small, Gemma), the
embedding is stored as int8 rows anyway, so by default (`lm_head="auto"`) an int4 or fp8 model
keeps an int8 head that shares those codes: one copy, fewer bytes than a separate int4/fp8 head
plus the int8 embedding, and far less error (a 4-bit head was the largest loss of int4 on
SmolLM2-135M, whose embedding came as Q8_0; docs/QUANT.md).

Every layer is checked before any is replaced, so an unsupported device, dtype or shape raises a
QuantizationError and leaves the model as it was.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from firstlight.quant.base import QuantizedModule
from firstlight.quant.calibrated import (
    DEFAULT_CALIBRATION,
    DEFAULT_METHODS,
    calibrate_layers,
    calibration_token_ids,
    default_cache_dir,
)
from firstlight.quant.int8 import Int8Embedding, Int8WeightOnlyLinear
from firstlight.quant.registry import QuantFormat, QuantizationError, get_format

NO_QUANTIZATION = ("none", "", None)
METHODS = ("rtn", "gptq")
LM_HEAD_CHOICES = ("auto", "same", "int8", "none")


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
    method: str = "rtn"
    calibration: str = ""  # what the calibrated method saw (corpus, tokens), and whether it came from cache
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
        how = self.method + (f" ({self.calibration})" if self.calibration else "")
        return (
            f"{self.format} [{how}]: {len(self.layers)} layers quantized, {len(self.skipped)} kept "
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
    return total + sum(m.opaque_bytes() for m in model.modules() if isinstance(m, QuantizedModule))


def _tensor_bytes(module: nn.Module) -> int:
    opaque = module.opaque_bytes() if isinstance(module, QuantizedModule) else 0
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()]) + opaque


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
    lm_head: str = "auto",
    method: str = "rtn",
    calibration_ids: Sequence[int] | None = None,
    calibration_name: str = "",
    cache_dir: Path | None = None,
    **opts: Any,
) -> QuantReport:
    """Quantize `model` in place with format `fmt` (a name from list_formats(), with `opts`).

    skip_lm_head keeps the output projection in the model's dtype (same as lm_head="none");
    lm_head="same" quantizes it in `fmt`, "int8" as int8, "auto" = int8 when it is tied to the
    embedding and `fmt` is not int8 (see the module docstring), else `fmt`. skip_embeddings keeps
    the token embedding (otherwise int8 rows with a per-row scale, shared with a tied int8 head);
    skip holds further module names to keep. method="gptq" needs calibration_ids (token ids of a
    text that is not the evaluation text) and caches its result under cache_dir when given.
    """
    qfmt = get_format(fmt, **opts) if isinstance(fmt, str) else fmt
    if method not in METHODS:
        raise QuantizationError(f"quantization method '{method}' is not one of {METHODS}")
    if lm_head not in LM_HEAD_CHOICES:
        raise QuantizationError(f"lm_head='{lm_head}' is not one of {LM_HEAD_CHOICES}")
    if method == "gptq" and not calibration_ids:
        raise QuantizationError("method 'gptq' needs calibration token ids (e.g. --calibration shakespeare)")
    if any(isinstance(m, QuantizedModule) for m in model.modules()):
        raise QuantizationError("this model is already quantized; load it again to quantize it another way")
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    kernel = qfmt.kernel_path(device, dtype)  # raises if the device has no kernel for this format

    head = getattr(model, "lm_head", None)
    emb_mod = getattr(model, "embed_tokens", None)
    tied = head is not None and emb_mod is not None and head.weight is emb_mod.weight
    head_choice = "none" if skip_lm_head else lm_head
    if head_choice == "auto":
        head_choice = "int8" if tied and qfmt.int8_tied_head and qfmt.name != "int8" and not skip_embeddings else "same"
    # float activations into the tied int8 head in every format, w4a8 too: firstlight::int8_mm with int8
    # activations measured no faster at the head's shape (docs/PERFORMANCE.md) and is less exact
    head_fmt = get_format("int8", compute_dtype=getattr(qfmt, "compute_dtype", "auto")) if head_choice == "int8" else qfmt
    kept = set(skip) | ({"lm_head"} if head_choice == "none" else set())
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in kept}
    embeddings = {} if skip_embeddings else {n: m for n, m in model.named_modules() if isinstance(m, nn.Embedding)}
    fmt_of = {n: head_fmt if n == "lm_head" else qfmt for n in linears}
    for name, linear in linears.items():
        try:
            fmt_of[name].check_linear(linear)
        except QuantizationError as e:
            raise QuantizationError(f"layer '{name}' {tuple(linear.weight.shape)}: {e}") from e

    report = QuantReport(qfmt.name, str(device), str(dtype).removeprefix("torch."), kernel, method)
    report.weight_bytes_before = model_weight_bytes(model)
    report.skipped = sorted(n for n, m in model.named_modules() if isinstance(m, nn.Linear | nn.Embedding)
                            and n not in linears and n not in embeddings)
    # GPTQ for the layers inside the blocks; a head that shares the embedding's int8 codes and the
    # embedding stay round-to-nearest (a head of its own, as w8a8 keeps, is calibrated too).
    own_head = head_choice == "same" and not qfmt.int8_tied_head
    calibrated = [n for n in linears if n != "lm_head" or own_head] if method == "gptq" else []
    with torch.no_grad():
        replaced: dict[str, nn.Module] = {}
        if calibrated:
            assert calibration_ids is not None
            replaced, report.calibration = calibrate_layers(
                model, qfmt, calibrated, calibration_ids, calibration_name, cache_dir)
        for name, linear in linears.items():
            q = replaced[name] if name in replaced else fmt_of[name].quantize_linear(linear)
            replaced[name] = q
            report.layers.append(QuantizedLayer(name, "linear", tuple(linear.weight.shape), q.kernel,
                                                _tensor_bytes(linear), _tensor_bytes(q)))
        for name, emb in embeddings.items():
            q_head = replaced.get("lm_head")
            if tied and isinstance(q_head, Int8WeightOnlyLinear):
                # Tied int8 head: the embedding reads the head's own codes and scales (no second copy).
                q = Int8Embedding(q_head.qweight, q_head.scales, emb.weight.dtype)
            else:
                q = Int8Embedding.from_embedding(emb)
            replaced[name] = q
            report.layers.append(QuantizedLayer(name, "embedding", tuple(emb.weight.shape), q.kernel,
                                                _tensor_bytes(emb), _tensor_bytes(q)))
        for name, module in replaced.items():
            _set_module(model, name, module)
    report.weight_bytes_after = model_weight_bytes(model)
    return report


def apply_quantization(
    model: nn.Module, fmt: str | None, *, tokenizer: Any = None, calibration: str | None = None,
    method: str = "auto", **opts: Any,
) -> QuantReport | None:
    """The hook for `generate` / `serve` / `verify --quantization FMT`: None or 'none' is a no-op.

    method="auto" runs each format's best measured method (DEFAULT_METHODS: GPTQ for int8 and fp8)
    when a tokenizer is given to turn the calibration corpus (default DEFAULT_CALIBRATION) into
    ids, else round-to-nearest; the report's `method` says which ran.
    """
    if fmt in NO_QUANTIZATION:
        return None
    if method == "auto":
        method = DEFAULT_METHODS.get(str(fmt), "rtn") if tokenizer is not None else "rtn"
    if method == "gptq":
        if tokenizer is None:
            raise QuantizationError("method 'gptq' needs the model's tokenizer to read its calibration corpus")
        corpus = calibration or DEFAULT_CALIBRATION
        ids = calibration_token_ids(tokenizer, corpus)
        opts = {"calibration_ids": ids, "calibration_name": corpus, "cache_dir": default_cache_dir(), **opts}
    return quantize_model(model, fmt, method=method, **opts)
