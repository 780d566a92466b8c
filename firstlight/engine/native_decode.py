"""The decode step of a dense decoder in one native call (firstlight::dense_decode, kernels/csrc/dense_decode.cpp).

At batch 1 the eager decode step of SmolLM2-135M int4 spent 15 ms in matmul kernels and 29 ms in the ~30 small
ops per layer around them (norms, rope, views, the K/V store, activation, residual adds: each a Python call and a
dispatcher hop). `NativeDecode` registers the model's weights and the runner's KV pools once, then runs every layer
of a decode step (one new token per row) in C++: the same matmul and paged-attention kernels the modules call, the
glue as plain loops. The embedding and the LM head stay the model's own modules.

It applies to models/dense.py's decoder (Llama, Mistral, Qwen2, Qwen3, SmolLM2) and models/gemma3.py's (Gemma 3:
(1 + w) norms, norms of the sublayer outputs, tanh-GELU, a rope per layer type) in fp32 on CPU, with fp32, bf16 or fp16 paged
pools and linears our kernels take: fp32 (nn.Linear / F32Linear), int4, w4a8, int8, int8 with int8 activations.
`NativeDecode.build` returns (None, why) for anything else and the runner keeps the module path, so a family or a
format it does not know still runs, and runs exactly as before.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch
from torch import nn

from firstlight import kernels
from firstlight.models.dense import DecoderLayer, DenseDecoder
from firstlight.models.gemma3 import Gemma3, Gemma3Layer
from firstlight.models.layers import Attention, CausalLM, GatedMLP, GemmaRMSNorm, RMSNorm
from firstlight.quant.f32 import (
    F32Linear,
    FusedGatedMLP,
    FusedGemmaRMSNorm,
    FusedRMSNorm,
    KernelAttention,
    onednn_min_rows,
)
from firstlight.quant.int4 import Int4WeightOnlyLinear
from firstlight.quant.int8 import Int8WeightOnlyLinear

if TYPE_CHECKING:
    from firstlight.engine.runner import PagedKVCache

F32, INT4, INT4_A8, INT8, INT8_A8, F32_PANELS = range(6)  # dense_decode.cpp Kind
_NONE = torch.empty(0)


def _linear(module: nn.Module) -> tuple[int, int, list[torch.Tensor]] | str:
    """(kind, group size, [a, b, c, bias]) of a linear the native step can run, else why not."""
    bias = getattr(module, "bias", None)
    bias = _NONE if bias is None else bias.detach()
    if isinstance(module, nn.Linear) and type(module).forward in (nn.Linear.forward, F32Linear.forward):
        w = module.weight
        if w.dtype != torch.float32 or not w.is_contiguous():
            return f"{type(module).__name__} weight is {w.dtype}, not contiguous fp32"
        prepared = module.prepared() if type(module) is F32Linear else None
        if prepared is not None and kernels.f32_panels():  # f32_pack's panels; the group field holds N
            return F32_PANELS, module.out_features, [prepared, _NONE, _NONE, bias]
        return F32, 0, [w.detach(), _NONE if prepared is None else prepared, _NONE, bias]
    if type(module) is Int4WeightOnlyLinear and module.ours:
        kind = INT4_A8 if module.activations == "int8" else INT4
        return kind, module.group_size, [module.packed, module.scales, module.mins, bias]
    if type(module) is Int8WeightOnlyLinear and module.ours:
        kind = INT8_A8 if module.activations == "int8" else INT8
        return kind, 0, [module.qweight, module.scales.float().contiguous(), _NONE, bias]
    return f"a {type(module).__name__} linear"


def _norm(module: nn.Module | None) -> torch.Tensor | str:
    """The w of w * (x / rms(x)): RMSNorm's weight (shared), GemmaRMSNorm's 1 + weight (a copy, fp32 as it computes)."""
    if module is None:
        return _NONE
    gemma = type(module) in (GemmaRMSNorm, FusedGemmaRMSNorm)
    if not (gemma or type(module) in (RMSNorm, FusedRMSNorm)) or module.weight.dtype != torch.float32:
        return f"a {type(module).__name__} norm"
    w = module.weight.detach()
    return (1.0 + w) if gemma else w.contiguous()


def _layer_norms(layer: nn.Module) -> tuple[nn.Module, nn.Module, nn.Module | None, nn.Module | None] | None:
    """(input norm, pre-MLP norm, attention output norm, MLP output norm) of a layer the native step runs."""
    if type(layer) is DecoderLayer:
        return layer.input_layernorm, layer.post_attention_layernorm, None, None
    if type(layer) is Gemma3Layer:
        return (layer.input_layernorm, layer.pre_feedforward_layernorm, layer.post_attention_layernorm,
                layer.post_feedforward_layernorm)
    return None


class NativeDecode:
    """A registered plan: the model's layers and the runner's pools, run per decode step by `__call__`."""

    def __init__(self, model: CausalLM, handle: int, kv_types: list[str]) -> None:
        self.model = model
        self.handle = handle
        self.kv_types = kv_types  # the KV cache groups, in the order the plan's layers index them
        cfg = model.config
        self.windows = [cfg.sliding_window if t == "sliding_attention" else 0 for t in kv_types]
        weakref.finalize(self, torch.ops.firstlight.dense_decode_free, handle)
        # cos / sin of positions 0 .. n - 1 per group, [n, Dr] each, grown as positions pass n: a decode step
        # looks its rows up (two index_selects a group) instead of building them (~8 ops). The model's own
        # rope_tables computes them, over arange(n) instead of the step's positions: the same elementwise ops.
        # Dynamic NTK scales by each row's length: never cached.
        self._cached_rope = all(cfg.rope[t].kind != "dynamic" for t in kv_types)
        self._cos: list[torch.Tensor] = []
        self._sin: list[torch.Tensor] = []

    @classmethod
    def build(cls, model: nn.Module, k_pools: list[torch.Tensor],
              v_pools: list[torch.Tensor]) -> tuple[NativeDecode | None, str]:
        """The plan for this model and these pools, or (None, the reason it does not apply)."""
        if kernels.load_kernel() is None:
            return None, "firstlight's kernel extension is not in use"
        if type(model) not in (DenseDecoder, Gemma3):
            return None, f"{type(model).__name__} is not models/dense.py's or gemma3.py's decoder"
        cfg = model.config
        if cfg.hidden_act not in kernels.GATED_ACTS:
            return None, f"activation {cfg.hidden_act}"
        if (any(p.device.type != "cpu" for p in k_pools + v_pools)
                or any(p.dtype not in (torch.float32, torch.bfloat16, torch.float16) for p in k_pools)):
            return None, "the KV pools are not fp32, bf16 or fp16 on CPU"
        kv_types = sorted(set(cfg.layer_types))
        tensors: list[torch.Tensor] = []
        final = _norm(model.norm)
        if isinstance(final, str):
            return None, final
        tensors.append(final)
        ints = [cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                kernels.GATED_ACTS[cfg.hidden_act], kernels.F32_MAX_TILED_M, kernels.MAX_TILED_M,
                kernels.A8_MAX_TILED_M, kernels.INT8_MAX_TILED_M, onednn_min_rows() or 0]
        scales = set()
        for i, layer in enumerate(model.layers):
            attn, mlp, norms = getattr(layer, "self_attn", None), getattr(layer, "mlp", None), _layer_norms(layer)
            if (norms is None or type(attn) not in (Attention, KernelAttention)
                    or type(mlp) not in (GatedMLP, FusedGatedMLP)):
                return None, f"layer {i} is a {type(layer).__name__}"
            if attn.output_gate or mlp.intermediate != cfg.intermediate_size:
                return None, f"layer {i}: gated attention output or its own MLP width"
            scales.add(attn.scale)
            ints += [kv_types.index(layer.layer_type), int(attn.use_rope)]
            in_norm, pre_mlp, attn_out, mlp_out = norms
            for norm in (in_norm, attn.q_norm, attn.k_norm, pre_mlp, attn_out, mlp_out):
                got = _norm(norm)
                if isinstance(got, str):
                    return None, f"layer {i}: {got}"
                tensors.append(got)
            for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                got = _linear(lin)
                if isinstance(got, str):
                    return None, f"layer {i}: {got}"
                kind, group, ts = got
                ints += [kind, group]
                tensors += ts
        if len(scales) != 1:
            return None, "the layers' attention scales differ"
        handle = torch.ops.firstlight.dense_decode_plan(tensors, ints, [cfg.rms_norm_eps, scales.pop()],
                                                        k_pools, v_pools)
        return cls(model, handle, kv_types), ""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: PagedKVCache) -> torch.Tensor:
        """input_ids, positions [B, 1] (no padding rows) -> the final-normed hidden states [B, 1, E]."""
        x = self.model.embed(input_ids)[:, 0]  # [B, E]
        cos, sin = self._rope(positions, x.dtype)
        views = [cache.views[t] for t in self.kv_types]
        hidden = torch.ops.firstlight.dense_decode(
            self.handle, x, positions[:, 0], cos, sin, [v.write_slots for v in views], [v.gather_slots for v in views],
            [v.key_positions for v in views], self.windows)
        return hidden[:, None]

    @property
    def _rope_len(self) -> int:
        """The positions the cached tables cover (0 before the first step)."""
        return self._cos[0].shape[0] if self._cos else 0

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """cos, sin per group for positions [B, 1] (rows of [B, Dr]; dense_decode reshapes either layout)."""
        if not self._cached_rope or positions.device.type != "cpu" or dtype != torch.float32:
            rope = self.model.rope_tables(positions, dtype)
            return [rope[t][0] for t in self.kv_types], [rope[t][1] for t in self.kv_types]
        pos = positions[:, 0]
        need = int(pos.max()) + 1
        if need > self._rope_len:
            n = max(need, 2 * self._rope_len, 256)
            rope = self.model.rope_tables(torch.arange(n)[None], torch.float32)  # [1, 1, n, Dr] each
            self._cos = [rope[t][0][0, 0] for t in self.kv_types]
            self._sin = [rope[t][1][0, 0] for t in self.kv_types]
        return [c.index_select(0, pos) for c in self._cos], [s.index_select(0, pos) for s in self._sin]
