"""Granite 4.0-H (`granitemoehybrid`): Mamba-2 layers interleaved with a few attention layers, each
followed by top-k routed experts plus an always-on shared MLP.

    x = embed(ids) * embedding_multiplier
    for each layer (`layer_types`: mamba | attention; Granite 4.0-H-Tiny: 1 attention per 10 layers):
        x = x + residual_multiplier * mixer(norm(x))    # Mamba2Mixer (mamba2.py), or attention with
                                                        # scale attention_multiplier and no rope (NoPE)
        h = norm(x)
        x = x + residual_multiplier * (moe(h) + shared_mlp(h))   # moe absent when num_local_experts = 0
    logits = lm_head(norm(x)) / logits_scaling

The multipliers are Granite's muP scalings. The router takes the softmax over the top-k logits, which
equals our Router's softmax over all experts renormalized over the top k (moe.py, norm_topk_prob).
Attention takes rope only when `position_embedding_type` is "rope" (Granite 4.0-H ships "nope").
"""

from __future__ import annotations

import torch
from torch import nn

from firstlight.models.config import MAMBA, ModelConfig
from firstlight.models.kv_cache import KVCache
from firstlight.models.layers import Attention, CausalLM, GatedMLP, RMSNorm
from firstlight.models.mamba2 import Mamba2Mixer
from firstlight.models.moe import Experts, Router


class GraniteMoE(nn.Module):
    """Routed experts without a gated shared expert (Granite's shared MLP sits beside it, ungated).
    HF module: `block_sparse_moe` (`router`, `experts`)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.router = Router(cfg)
        self.experts = Experts(cfg)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        shape = h.shape  # [B, S, E]: every token of every row is routed together
        x = h.reshape(-1, shape[-1])  # [T, E]
        weights, experts = self.router(x)
        return self.experts(x, weights, experts).view(shape)


class GraniteMoeHybridLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer_type = cfg.layer_types[layer]
        self.residual_multiplier = cfg.residual_multiplier
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.layer_type == MAMBA:
            self.mamba = Mamba2Mixer(cfg, layer)
        else:
            self.self_attn = Attention(cfg, layer, RMSNorm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.block_sparse_moe = GraniteMoE(cfg) if cfg.moe is not None else None
        self.shared_mlp = GatedMLP(cfg)  # HF: shared_mlp.input_linear (gate | up), output_linear

    def forward(
        self,
        x: torch.Tensor,
        rope: dict[str, tuple[torch.Tensor, torch.Tensor]],
        masks: dict[str, torch.Tensor | str | None],
        cache: KVCache,
    ) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.layer_type == MAMBA:
            h = self.mamba(h, cache)
        else:
            cos, sin = rope[self.layer_type]
            h = self.self_attn(h, cos, sin, masks[self.layer_type], cache)
        x = x + h * self.residual_multiplier
        h = self.post_attention_layernorm(x)
        out = self.shared_mlp(h)
        if self.block_sparse_moe is not None:
            out = self.block_sparse_moe(h) + out
        return x + out * self.residual_multiplier


class GraniteMoeHybrid(CausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, GraniteMoeHybridLayer, RMSNorm)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.config.embedding_multiplier

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden) / self.config.logits_scaling
