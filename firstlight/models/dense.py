"""Dense decoder-only transformers: Llama (incl. Llama-3 rope scaling), Mistral (sliding window),
Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm).

    x = embed(ids)
    for each layer:  x = x + attn(norm(x));  x = x + mlp(norm(x))
    logits = lm_head(norm(x))

The differences between the four are all in ModelConfig (biases, q/k norm, windows, rope); the
HF weight names are mapped in hf_names.py.
"""

from __future__ import annotations

import torch
from torch import nn

from firstlight.models.config import ModelConfig
from firstlight.models.kv_cache import KVCache
from firstlight.models.layers import Attention, CausalLM, GatedMLP, RMSNorm


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer_type = cfg.layer_types[layer]
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer, RMSNorm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg)

    def forward(
        self,
        x: torch.Tensor,
        rope: dict[str, tuple[torch.Tensor, torch.Tensor]],
        masks: dict[str, torch.Tensor | str | None],
        cache: KVCache,
    ) -> torch.Tensor:
        cos, sin = rope[self.layer_type]
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, masks[self.layer_type], cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class DenseDecoder(CausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, DecoderLayer, RMSNorm)
