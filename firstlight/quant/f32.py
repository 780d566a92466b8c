"""fp32 linears on CPU through firstlight's own matmuls: on an AVX-512 build of the extension, one kernel on a
copy of the weight packed once into panels of 32 output columns (`firstlight::f32_mm_packed`) at every row
count; elsewhere our small-batch tiles on the weight in place (`firstlight::f32_mm`) for decode-sized batches and
oneDNN's matmul (torch's mkldnn) on a weight reordered once into its blocked layout above them.

Not a quantization: the weights stay the model's own fp32 tensors (shared, so a tied LM head stays tied and
state_dict keys do not change); only the matmul that multiplies them changes, and only its summation order.
Why: at 2..32 activation rows the BLAS packs every weight on every call (docs/PERFORMANCE.md, "fp32 at
decode-sized batches"); above, torch's BLAS (MKL) runs its AVX2 code on AMD CPUs, while oneDNN picks the
CPU's widest ISA (2.2-2.9x MKL from 16 rows up on an AVX-512 EPYC); the packed panels beat oneDNN's matmul on
cold weights at decode sizes (a decode step's 121 linears of SmolLM2-135M at 32 rows: 25.5 vs 34.6 ms) and tie
it on a prefill's (benchmarks/f32_gemm.py). The prepared copy (panels or oneDNN's) is made at the first call that
needs it, costs the weight's size again, and is remade if the weight changes in place.
The serving engine's loader applies it (engine/llm.py `load`); FIRSTLIGHT_CPU_KERNELS=aten turns it off with
the other kernels of the extension.
"""

from __future__ import annotations

import warnings
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from firstlight import kernels
from firstlight.models.layers import ACTIVATIONS, Attention, GatedMLP, GemmaRMSNorm, RMSNorm

_state: dict[str, int | None] = {}
# F32Linear -> ((weight data_ptr, version, panels?), its prepared copy: f32_pack's panels or oneDNN's reordered
# weight): outside the module, so state_dict, .to(), deepcopy and pickling never meet it (a copy makes its own)
_PREPARED: weakref.WeakKeyDictionary[nn.Module, tuple[tuple[int, int, bool], torch.Tensor]] = (
    weakref.WeakKeyDictionary())


def onednn_min_rows() -> int | None:
    """Above this many activation rows an fp32 linear runs on oneDNN's matmul; None where torch has no oneDNN.

    Where the CPU has AVX-512, oneDNN runs it and MKL does not: from 16 rows up it beat our 8-lane tiles
    (1.6x at 16, 1.4x at 32 on cold weights), at 8 the two tie; with AVX2 only, our tiles win up to their limit.
    """
    if "onednn" not in _state:
        ok = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        _state["onednn"] = None if not ok else (
            8 if torch.backends.cpu.get_cpu_capability() == "AVX512" else kernels.F32_MAX_TILED_M)
    return _state["onednn"]


def onednn_linear(x: torch.Tensor, reordered: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] times a weight reordered by oneDNN (+ bias): torch's mkldnn::_linear_pointwise."""
    return torch.ops.mkldnn._linear_pointwise(x, reordered, bias, "none", [], "")


def _give_up_onednn(error: Exception) -> None:
    """A torch whose oneDNN cannot take it: our tiles and the BLAS for every fp32 linear, from now on."""
    warnings.warn(f"oneDNN fp32 matmul unavailable ({error}); fp32 linears above {kernels.F32_MAX_TILED_M} rows "
                  "use the BLAS", stacklevel=3)
    _state["onednn"] = None


def _on_kernel(x: torch.Tensor, weight: torch.Tensor | None = None) -> bool:
    """True where our kernels take x (and weight): fp32 on CPU, no autograd recording (they have no backward)."""
    if weight is not None and weight.dtype != torch.float32:
        return False
    return x.dtype == torch.float32 and x.device.type == "cpu" and not (
        torch.is_grad_enabled() and (x.requires_grad or (weight is not None and weight.requires_grad)))


class F32Linear(nn.Linear):
    """nn.Linear whose fp32 CPU products go through firstlight::f32_mm_packed on an AVX-512 build, else
    firstlight::f32_mm and oneDNN above onednn_min_rows() (the BLAS where oneDNN is missing or fails); with
    autograd recording (a tensor that requires grad), torch's F.linear; inside torch.compile, f32_mm only (the
    graph keeps one op of ours, no prepared copy)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _on_kernel(x, self.weight):
            return F.linear(x, self.weight, self.bias)  # the op has no backward: autograd keeps torch's
        x2 = x.reshape(-1, x.shape[-1])
        y = None if torch.compiler.is_compiling() else self._on_prepared(x2)
        if y is None:
            y = kernels.f32_mm(x2, self.weight, self.bias)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def _on_prepared(self, x2: torch.Tensor) -> torch.Tensor | None:
        """x2's product on the prepared copy: the panels, or oneDNN above its row limit; None: f32_mm's tiles."""
        if kernels.f32_panels():
            return kernels.f32_mm_packed(x2, self.prepared(), self.out_features, self.bias)
        min_rows = onednn_min_rows()
        if min_rows is None or x2.shape[0] <= min_rows or (reordered := self.prepared()) is None:
            return None
        try:
            return onednn_linear(x2, reordered, self.bias)
        except RuntimeError as e:
            _give_up_onednn(e)
            return None

    def prepared(self) -> torch.Tensor | None:
        """The weight's copy for this machine's matmul, made now if missing or stale (the weight changed in place
        since; an inference tensor, made under torch.inference_mode, has no version counter: only its storage is
        compared): f32_pack's panels on an AVX-512 build, else oneDNN's reordered weight (None without oneDNN)."""
        w = self.weight
        panels = kernels.f32_panels()
        key = (w.data_ptr(), -1 if w.is_inference() else w._version, panels)
        got = _PREPARED.get(self)
        if got is None or got[0] != key:
            if panels:
                copy = kernels.f32_pack(w.detach())
            elif onednn_min_rows() is None:
                return None
            else:
                try:
                    copy = torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)
                except RuntimeError as e:
                    _give_up_onednn(e)
                    return None
            got = (key, copy)
            _PREPARED[self] = got
        return got[1]


class FusedGatedMLP(GatedMLP):
    """GatedMLP whose act(gate) * up is firstlight::gated_act: one pass over the fused projection's output and one
    new tensor (torch: an activation pass, a multiply pass and an intermediate; a 2,048-token prefill step of
    SmolLM2 took 1.75 s with torch's, 1.37 s with ours, medians of 10 alternating rounds)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate_up_proj(x)
        if not _on_kernel(h):
            gate, up = h.split(self.intermediate, dim=-1)  # the op has no backward, nor other dtypes
            return self.down_proj(self.act(gate) * up)
        return self.down_proj(kernels.gated_act(h, self.act_name))


class FusedRMSNorm(RMSNorm):
    """RMSNorm in one pass per row (firstlight::rms_norm) where it applies (torch's: five passes over the
    activations and four new tensors, twice a layer)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _on_kernel(x, self.weight) or torch.compiler.is_compiling():
            return super().forward(x)  # (a compiled graph fuses its own)
        return kernels.rms_norm(x, self.weight, self.eps)


class FusedGemmaRMSNorm(GemmaRMSNorm):
    """GemmaRMSNorm, (1 + w) * (x / rms(x)), as FusedRMSNorm."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _on_kernel(x, self.weight) or torch.compiler.is_compiling():
            return super().forward(x)  # (a compiled graph fuses its own)
        return kernels.rms_norm(x, 1.0 + self.weight, self.eps)


class KernelAttention(Attention):
    """Attention whose rotary embedding is one pass (firstlight::rope) where it applies."""

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if not _on_kernel(x) or cos.dtype != torch.float32 or cos.dim() != 4 or torch.compiler.is_compiling():
            return super().rotate(x, cos, sin)
        return kernels.rope(x, cos, sin)


_GLUE = {RMSNorm: FusedRMSNorm, GemmaRMSNorm: FusedGemmaRMSNorm, Attention: KernelAttention}


def use_f32_kernel(model: nn.Module) -> int:
    """Route every plain fp32 nn.Linear of a CPU model through our fp32 matmuls (F32Linear), every
    GatedMLP with a silu or tanh-GELU gate through firstlight::gated_act (fp32 CPU activations; whatever format its
    linears are in), and its RMSNorms and attention's rope through firstlight::rms_norm and rope (fp32 CPU, eager,
    without autograd; otherwise each falls back to its module's own forward); returns how many linears.

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
    for module in model.modules():
        act = next((a for a in kernels.GATED_ACTS if module.__dict__.get("act") is ACTIVATIONS[a]), None)
        if type(module) is GatedMLP and act is not None:  # whatever its linears' format: it acts on their output
            module.__class__ = FusedGatedMLP
            module.act_name = act
        elif type(module) in _GLUE:
            module.__class__ = _GLUE[type(module)]
    return swapped
