"""Gemma 3 (text): a genuinely different decoder.

    x = embed(ids) * sqrt(E)
    for each layer (5 sliding-window : 1 global, each with its own rope base):
        x = x + post_attn_norm(attn(pre_attn_norm(x)))      # q/k RMSNorm per head inside attn
        x = x + post_mlp_norm(mlp(pre_mlp_norm(x)))         # GELU(tanh) gated MLP
    logits = lm_head(norm(x))                               # tied to the embedding

Norms scale by (1 + w) in fp32; attention scales by query_pre_attn_scalar^-0.5 (Gemma 3 tech
report, 2025).
"""

from __future__ import annotations

import torch
from torch import nn

from firstlight.models.config import ModelConfig
from firstlight.models.kv_cache import KVCache
from firstlight.models.layers import Attention, CausalLM, GatedMLP, GemmaRMSNorm


class Gemma3Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer_type = cfg.layer_types[layer]
        eps = cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.self_attn = Attention(cfg, layer, GemmaRMSNorm)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.mlp = GatedMLP(cfg)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)

    def forward(
        self,
        x: torch.Tensor,
        rope: dict[str, tuple[torch.Tensor, torch.Tensor]],
        masks: dict[str, torch.Tensor | str | None],
        cache: KVCache,
    ) -> torch.Tensor:
        cos, sin = rope[self.layer_type]
        attn = self.self_attn(self.input_layernorm(x), cos, sin, masks[self.layer_type], cache)
        x = x + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(mlp)


class Gemma3(CausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, Gemma3Layer, GemmaRMSNorm)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # Scaled by sqrt(E), the normalizer rounded to the model dtype first, as the reference does.
        return x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
