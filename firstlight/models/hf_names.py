"""Mapping between HF tensor names and ours, in two steps.

1. Ours ↔ transformers' in-memory names (`hf_name`, what the verify harness reads from the reference).
   Ours drop the `model.` prefix and fuse groups of projections (one matmul each in decode):
    self_attn.{q,k,v}_proj.{weight,bias}  →  self_attn.qkv_proj.{weight,bias}   (concatenated on dim 0)
    mlp.{gate,up}_proj.{weight,bias}      →  mlp.gate_up_proj.{weight,bias}
    mlp.shared_expert.{gate,up}_proj      →  mlp.shared_expert.gate_up_proj
    mlp.shared_experts.{gate,up}_proj     →  mlp.shared_experts.gate_up_proj    (DeepSeek-V3)
    shared_mlp.{input,output}_linear      →  shared_mlp.{gate_up,down}_proj     (Granite; a rename)
    linear_attn.in_proj_{qkv,z,b,a}       →  linear_attn.in_proj                (Qwen3.5's Gated DeltaNet)
    mixer.{q,k,v}_proj                    →  mixer.qkv_proj                     (Nemotron-H's attention)
   A family may name the embedding and the final norm otherwise (`model_type`): Nemotron-H's are
   `embeddings` and `norm_f` (ours: `embed_tokens`, `norm`); DeepSeek-V3's MTP depths (ours: `mtp.{i}`, i
   their layer index in the files) are `model.layers.{i}`. Everything else keeps its HF name; routed experts are stacked in memory by transformers as by us
   (`mlp.experts.gate_up_proj` [X, 2I, E], `mlp.experts.down_proj` [X, E, I]).

2. In-memory ↔ checkpoint-file names (`checkpoint_names`): transformers 5 converts at load time, and
   writes the classic layout back on save. The files keep one tensor per expert:
    qwen*_moe:  mlp.experts.{i}.{gate,up,down}_proj.weight
    mixtral:    block_sparse_moe.experts.{i}.{w1,w3,w2}.weight  (gate, up, down), block_sparse_moe.gate
    granitemoehybrid: stacked as in memory, named block_sparse_moe.{input_linear,output_linear}.weight and
                block_sparse_moe.router.layer.weight (transformers' `granitemoe` WeightRenaming)
    nemotron_h: `backbone.` for `model.`, ungated experts mixer.experts.{i}.{up,down}_proj.weight
                (transformers' `nemotron_h` WeightRenaming and MergeModulelist)
   (Qwen3.5-MoE hub files keep the experts stacked as in memory; both layouts load.)
   A multimodal wrapper's files hold the text model under `model.language_model.` (transformers'
   `PrefixChange` for qwen3_5_text) beside its vision tower; `text_model_name` maps them back.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "shared_expert.gate_up_proj": ("shared_expert.gate_proj", "shared_expert.up_proj"),
    "shared_experts.gate_up_proj": ("shared_experts.gate_proj", "shared_experts.up_proj"),  # DeepSeek-V3
    "shared_mlp.gate_up_proj": ("shared_mlp.input_linear",),  # one part: a rename
    "shared_mlp.down_proj": ("shared_mlp.output_linear",),
    "linear_attn.in_proj": ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_b",
                            "linear_attn.in_proj_a"),
    "mixer.qkv_proj": ("mixer.q_proj", "mixer.k_proj", "mixer.v_proj"),
}
# model_type -> {our top-level module: its HF name}
TOP_RENAMES = {"nemotron_h": {"embed_tokens": "embeddings", "norm": "norm_f"}, "deepseek_v3": {"mtp": "layers"}}
# Tensors some checkpoints carry that are derived at run time, not weights.
IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


def _prefix(ours: str) -> str:
    # the LM head and Qwen3-Next's MTP layers sit beside `model.`, not in it
    return "" if ours.startswith(("lm_head", "mtp.")) or ours == "mtp" else "model."


WRAPPED_TEXT_MODEL = "model.language_model."
# The vision tower of each multimodal family whose text model alone we run
VISION_TOWERS = {"qwen3_5_moe": ("model.visual.",)}


def text_model_name(file_name: str, model_type: str) -> str | None:
    """A checkpoint-file tensor's name in the text model's layout (`model.language_model.X` → `model.X`),
    or None for a tensor of the family's vision tower, which is not read."""
    if file_name.startswith(VISION_TOWERS.get(model_type, ())):
        return None
    if file_name.startswith(WRAPPED_TEXT_MODEL):
        return "model." + file_name.removeprefix(WRAPPED_TEXT_MODEL)
    return file_name


def _renamed(ours: str, model_type: str) -> str:
    head, dot, rest = ours.partition(".")
    return TOP_RENAMES.get(model_type, {}).get(head, head) + dot + rest


def hf_name(ours: str, model_type: str = "") -> list[str]:
    """The HF tensor names that make up one of our tensors (several for a fused one)."""
    ours = _renamed(ours, model_type)
    prefix = _prefix(ours)
    for fused, parts in FUSED.items():
        marker = f".{fused}."
        if marker in ours:
            head, tail = ours.split(marker)
            return [f"{prefix}{head}.{part}.{tail}" for part in parts]
    return [prefix + ours]


def hf_module_name(ours: str, model_type: str = "") -> str:
    """HF module path for one of our module paths (fused modules map to their first part)."""
    ours = _renamed(ours, model_type)
    prefix = _prefix(ours)
    for fused, parts in FUSED.items():
        if ours.endswith("." + fused):  # the dot: `shared_mlp.gate_up_proj` is not `mlp.gate_up_proj`
            return prefix + ours[: -len(fused)] + parts[0]
    return prefix + ours


# file names of one expert's (gate, up, down) projection, per family
_EXPERT_FILE_NAMES = {
    "mixtral": ("block_sparse_moe.experts.{i}.w1", "block_sparse_moe.experts.{i}.w3", "block_sparse_moe.experts.{i}.w2"),
}
_QWEN_EXPERT = ("mlp.experts.{i}.gate_proj", "mlp.experts.{i}.up_proj", "mlp.experts.{i}.down_proj")
EXPERT_FILE_INDEX = re.compile(r"^(?:model|backbone)\.layers\.(\d+)\.(?:mlp|block_sparse_moe|mixer)\.experts\.(\d+)\.")
STACKED_EXPERTS = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(?:gate_up_proj|down_proj)$")  # [X, ...]


def expert_file_names(model_type: str) -> tuple[str, str, str]:
    """Templates (format with i=expert) of one expert's (gate, up, down) file names inside model.layers.N."""
    return _EXPERT_FILE_NAMES.get(model_type, _QWEN_EXPERT)


def router_file_name(model_type: str) -> str:
    """The router's file name inside model.layers.N (no `.weight`)."""
    return "block_sparse_moe.gate" if model_type == "mixtral" else "mlp.gate"


# in-memory → file names of the stacked expert tensors, per family that renames them on save
_FILE_RENAMES = {
    "granitemoehybrid": {
        "block_sparse_moe.experts.gate_up_proj": "block_sparse_moe.input_linear.weight",
        "block_sparse_moe.experts.down_proj": "block_sparse_moe.output_linear.weight",
        "block_sparse_moe.router.weight": "block_sparse_moe.router.layer.weight",
    },
}


def checkpoint_names(hf: str, model_type: str, num_experts: int) -> list[str] | list[list[str]]:
    """The checkpoint-file tensors an in-memory HF tensor is built from: for stacked experts a list
    per expert (stacked on a new dim 0) of parts concatenated on dim 0; else the one file name."""
    if model_type == "nemotron_h":
        return _nemotron_h_file_names(hf, num_experts)
    for memory, file in _FILE_RENAMES.get(model_type, {}).items():
        if hf.endswith("." + memory):
            return [hf[: -len(memory)] + file]
    head, sep, tail = hf.partition(".mlp.")
    if not sep:
        return [hf]
    gate, up, down = expert_file_names(model_type)
    if tail in ("experts.gate_up_proj", "experts.down_proj"):
        parts = (gate, up) if tail == "experts.gate_up_proj" else (down,)
        return [[f"{head}.{p.format(i=i)}.weight" for p in parts] for i in range(num_experts)]
    if model_type == "mixtral" and tail == "gate.weight":
        return [f"{head}.{router_file_name(model_type)}.weight"]
    return [hf]


def _nemotron_h_file_names(hf: str, num_experts: int) -> list[str] | list[list[str]]:
    file = "backbone." + hf.removeprefix("model.") if hf.startswith("model.") else hf
    head, sep, tail = file.partition(".mixer.experts.")
    if sep and tail in ("up_proj", "down_proj"):  # one tensor per expert: [[name] for each expert]
        return [[f"{head}.mixer.experts.{i}.{tail}.weight"] for i in range(num_experts)]
    return [file]


def build_state_dict(
    our_names: list[str],
    get_hf: Callable[[str], torch.Tensor],
    model_type: str = "",
    num_experts: int = 0,
    has: Callable[[str], bool] = lambda n: True,
) -> tuple[dict[str, torch.Tensor], set[str]]:
    """Our state dict from checkpoint tensors fetched by name (`get_hf` raises for a missing one),
    and the checkpoint names it used. `has` says whether the file holds a name as is (in-memory
    layout); otherwise the per-expert file layout of `checkpoint_names` is read."""
    out, used = {}, set()
    for name in our_names:
        parts = []
        for hf in hf_name(name, model_type):
            names = [hf] if has(hf) else checkpoint_names(hf, model_type, num_experts)
            if isinstance(names[0], list):  # per-expert files: [X, ...]
                used.update(n for group in names for n in group)
                parts.append(torch.stack([torch.cat([get_hf(n) for n in group], dim=0) for group in names]))
            else:
                used.update(names)
                parts.append(get_hf(names[0]))
        out[name] = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    return out, used

