"""Helpers shared by the tiny and real-model parity tests: ours vs HF transformers."""

from __future__ import annotations

from pathlib import Path

import torch

from firstlight.models.generate import generate_tokens
from firstlight.models.kv_cache import ContiguousKVCache
from firstlight.models.layers import CausalLM

# fp32 tolerance: max |ours - ref| relative to the reference logit range (max - min).
FP32_REL_TOL = 1e-4


def hf_reference(path: Path, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").eval()


@torch.no_grad()
def logit_errors(ours: CausalLM, ref, ids: torch.Tensor) -> tuple[float, float]:
    """(max abs error, max abs error / reference logit range) over all positions."""
    a = ours(ids).float()
    b = ref(ids).logits.float()
    err = (a - b).abs().max().item()
    return err, err / (b.max() - b.min()).item()


@torch.no_grad()
def hf_greedy(ref, prompt: list[int], n: int) -> list[int]:
    out = ref.generate(
        torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
        eos_token_id=None, pad_token_id=0,
    )
    return out[0, len(prompt):].tolist()


def our_greedy(ours: CausalLM, prompt: list[int], n: int) -> list[int]:
    return list(generate_tokens(ours, prompt, n, temperature=0.0))


@torch.no_grad()
def incremental_error(ours: CausalLM, ids: torch.Tensor, prefill: int) -> float:
    """Max |logits| difference between prefill + one-token decode steps and one full forward."""
    batch, seq = ids.shape
    cfg = ours.config
    full = ours(ids)
    cache = ContiguousKVCache(cfg.num_layers, batch, cfg.num_kv_heads, cfg.head_dim, seq)
    parts = [ours(ids[:, :prefill], torch.arange(prefill).expand(batch, -1), cache)]
    for t in range(prefill, seq):
        parts.append(ours(ids[:, t : t + 1], torch.full((batch, 1), t), cache))
    return (torch.cat(parts, dim=1) - full).abs().max().item()


@torch.no_grad()
def chunked_prefill_error(ours: CausalLM, ids: torch.Tensor, chunk: int) -> float:
    """Max |logits| difference between a prefill in chunks of `chunk` tokens and one full forward."""
    batch, seq = ids.shape
    cfg = ours.config
    full = ours(ids)
    cache = ContiguousKVCache(cfg.num_layers, batch, cfg.num_kv_heads, cfg.head_dim, seq)
    parts = []
    for start in range(0, seq, chunk):
        stop = min(seq, start + chunk)
        parts.append(ours(ids[:, start:stop], torch.arange(start, stop).expand(batch, -1), cache))
    return (torch.cat(parts, dim=1) - full).abs().max().item()


def tensor_from_files(files: dict[str, torch.Tensor], name: str, family: str, num_experts: int) -> torch.Tensor:
    """The in-memory HF tensor `name` built from hub-layout file tensors (one tensor per expert stacked),
    for the MTP layers transformers does not load, rebuilt from its modules."""
    from firstlight.models.hf_names import checkpoint_names

    names = [name] if name in files else checkpoint_names(name, family, num_experts)
    if isinstance(names[0], list):  # per-expert files, stacked
        return torch.stack([torch.cat([files[n] for n in group]) for group in names])
    return files[names[0]]
