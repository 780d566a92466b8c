"""Qwen3-Next: a hybrid of Gated DeltaNet linear attention and gated full attention, with sparse MoE
MLPs and a native multi-token-prediction (MTP) layer.

    x = embed(ids)
    for each layer (3 linear-attention : 1 full-attention, `layer_types`):
        x = x + mixer(norm(x))     # GatedDeltaNet (gated_deltanet.py), or attention whose output is
                                   # multiplied by sigmoid(gate), gate from q_proj; q/k RMSNorm; partial rope
        x = x + moe(norm(x))       # routed experts + a sigmoid-gated shared expert (moe.py)
    logits = lm_head(norm(x))

Norms scale by (1 + w) (GemmaRMSNorm). The MTP layer (DeepSeek-V3 style, Liu et al. 2024, sec. 2.2)
predicts the token after next from the model's final hidden state at t and the embedding of token t+1:

    h' = layer(fc([norm_e(embed(token_{t+1})), norm_h(hidden_t)]))      at position t
    logits_{t+2} = lm_head(norm(h'))

transformers does not implement the MTP layer (it skips `mtp.*` on load); its weights are ours to run.
"""

from __future__ import annotations

import torch
from torch import nn

from firstlight.models.config import FULL, LINEAR, ModelConfig
from firstlight.models.gated_deltanet import GatedDeltaNet
from firstlight.models.kv_cache import KVCache
from firstlight.models.layers import Attention, GemmaRMSNorm, MTPCausalLM
from firstlight.models.moe import SparseMoE, mlp_for_layer


class Qwen3NextLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, layer_type: str | None = None, sparse: bool | None = None) -> None:
        super().__init__()
        self.layer_type = layer_type or cfg.layer_types[layer]
        eps = cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        if self.layer_type == LINEAR:
            self.linear_attn = GatedDeltaNet(cfg, layer)
        else:
            self.self_attn = Attention(cfg, layer, GemmaRMSNorm)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.mlp = SparseMoE(cfg) if sparse else mlp_for_layer(cfg, layer)

    def forward(
        self,
        x: torch.Tensor,
        rope: dict[str, tuple[torch.Tensor, torch.Tensor]],
        masks: dict[str, torch.Tensor | str | None],
        cache: KVCache,
    ) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.layer_type == LINEAR:
            h = self.linear_attn(h, cache)
        else:
            cos, sin = rope[self.layer_type]
            h = self.self_attn(h, cos, sin, masks[self.layer_type], cache)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class MTP(nn.Module):
    """The checkpoint's multi-token-prediction layers (`mtp.*`); layer i caches as layer num_layers + i."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        e, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.fc = nn.Linear(2 * e, e, bias=False)
        self.pre_fc_norm_embedding = GemmaRMSNorm(e, eps)
        self.pre_fc_norm_hidden = GemmaRMSNorm(e, eps)
        sparse = cfg.moe is not None
        self.layers = nn.ModuleList(
            Qwen3NextLayer(cfg, cfg.num_layers + i, layer_type=FULL, sparse=sparse) for i in range(cfg.num_mtp_layers)
        )
        self.norm = GemmaRMSNorm(e, eps)

    def forward(
        self,
        hidden: torch.Tensor,
        embeds: torch.Tensor,
        rope: dict[str, tuple[torch.Tensor, torch.Tensor]],
        masks: dict[str, torch.Tensor | str | None],
        cache: KVCache,
        step: int = 0,
    ) -> torch.Tensor:
        """norm(layer(fc([norm_e(embeds), norm_h(hidden)]))), the layer picked by step mod their count."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        return self.norm(self.layers[step % len(self.layers)](x, rope, masks, cache))

    def step_modules(self, step: int = 0) -> tuple[nn.Module, ...]:
        """What one MTP step reads besides the LM head: fc and the step's layer."""
        return self.fc, self.layers[step % len(self.layers)]


class Qwen3Next(MTPCausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, Qwen3NextLayer, GemmaRMSNorm)
        self.mtp = MTP(cfg) if cfg.num_mtp_layers else None
