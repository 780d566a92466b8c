"""Mapping between HF checkpoint tensor names and ours.

Ours drop the `model.` prefix and fuse two groups of projections (one matmul each in decode):
    self_attn.{q,k,v}_proj.{weight,bias}  →  self_attn.qkv_proj.{weight,bias}   (concatenated on dim 0)
    mlp.{gate,up}_proj.{weight,bias}      →  mlp.gate_up_proj.{weight,bias}
Everything else keeps its HF name.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
# Tensors some checkpoints carry that are derived at run time, not weights.
IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


def hf_name(ours: str) -> list[str]:
    """The HF tensor names that make up one of our tensors (several for a fused one)."""
    prefix = "" if ours.startswith("lm_head") else "model."
    for fused, parts in FUSED.items():
        marker = f".{fused}."
        if marker in ours:
            head, tail = ours.split(marker)
            return [f"{prefix}{head}.{part}.{tail}" for part in parts]
    return [prefix + ours]


def hf_module_name(ours: str) -> str:
    """HF module path for one of our module paths (fused modules map to their first part)."""
    prefix = "" if ours.startswith("lm_head") else "model."
    for fused, parts in FUSED.items():
        if ours.endswith(fused):
            return prefix + ours[: -len(fused)] + parts[0]
    return prefix + ours


def build_state_dict(
    our_names: list[str], get_hf: Callable[[str], torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Our state dict from HF tensors fetched by name (`get_hf` raises KeyError for a missing one)."""
    out = {}
    for name in our_names:
        parts = [get_hf(n) for n in hf_name(name)]
        out[name] = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    return out

