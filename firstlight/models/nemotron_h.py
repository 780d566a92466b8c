"""Nemotron-H (`nemotron_h`, NVIDIA 2025, arXiv:2504.03624): a stack of one-module blocks, each a
Mamba-2 mixer, an attention layer, an MLP or a mixture of experts, in the order `hybrid_override_pattern`
spells (M, *, -, E per layer; Nemotron-H-8B: "M-M-M-M*-M-M-M-M-M*-...", mostly Mamba-2 and MLP).

    x = embed(ids)
    for each layer:  x = x + block(norm(x))     # block: Mamba2Mixer (mamba2.py) | attention (no rope)
                                                #        | relu2 MLP | MoE (routed experts + shared MLP)
    logits = lm_head(norm(x))                   # never tied to the embedding

Against Granite 4.0-H (granitemoehybrid.py), which pairs every mixer with an FFN in one layer: one
module and one norm per layer; no muP multipliers; MLPs are ungated, down(relu(up(x))^2); the MoE
routes DeepSeek-V3 style (moe.py's SigmoidGroupRouter) over ungated experts, optionally in a latent
width, and always adds a shared MLP; attention has no biases whatever `attention_bias` says. The Mamba-2
mixer is Granite's, with the gated norm over n_groups groups, and dt clamped to time_step_limit (none by
default) in prefill and decode alike, as transformers from 5.25 on and Mamba-2's dt_limit; time_step_min only
sets the dt bias's initial range (transformers up to 5.24 clamped there, in its chunked scan only).

HF module names are kept (`layers.i.norm`, `layers.i.mixer`); hf_names.py maps the embedding and the
final norm (`embeddings`, `norm_f`) and the `backbone.` prefix of the checkpoint files.
"""

from __future__ import annotations

import torch
from torch import nn

from firstlight.models.config import FULL, MAMBA, MLP, MOE, ModelConfig
from firstlight.models.kv_cache import KVCache
from firstlight.models.layers import ACTIVATIONS, Attention, CausalLM, RMSNorm
from firstlight.models.mamba2 import Mamba2Mixer
from firstlight.models.moe import Experts, SigmoidGroupRouter


class NemotronHRMSNorm(RMSNorm):
    """RMSNorm that scales by the weight in fp32 before casting back (transformers' NemotronHRMSNorm;
    Llama's casts first). The same in fp32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x32).to(x.dtype)


class NemotronHMLP(nn.Module):
    """down(act(up(x))), ungated (act: relu2). An `-` block, and the MoE's shared expert."""

    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        inter = intermediate_size or cfg.intermediate_size
        self.up_proj = nn.Linear(cfg.hidden_size, inter, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(inter, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class NemotronHMoE(nn.Module):
    """An `E` block: routed ungated experts (in the latent width, if any) + an always-on shared MLP."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe = cfg.moe
        assert moe is not None
        self.gate = SigmoidGroupRouter(cfg)
        self.experts = Experts(cfg)
        self.shared_experts = NemotronHMLP(cfg, moe.shared_expert_intermediate_size)
        self.fc1_latent_proj = self.fc2_latent_proj = None
        if moe.latent_size is not None:
            self.fc1_latent_proj = nn.Linear(cfg.hidden_size, moe.latent_size, bias=cfg.mlp_bias)
            self.fc2_latent_proj = nn.Linear(moe.latent_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        shape = h.shape  # [B, S, E]: every token of every row is routed together
        x = h.reshape(-1, shape[-1])  # [T, E]
        weights, experts = self.gate(x)
        if self.fc1_latent_proj is not None:
            x = self.fc1_latent_proj(x)  # [T, latent]
        out = self.experts(x, weights, experts)
        if self.fc2_latent_proj is not None:
            out = self.fc2_latent_proj(out)
        return out.view(shape) + self.shared_experts(h)


class NemotronHBlock(nn.Module):
    """One layer: x + mixer(norm(x)), the mixer of the layer's kind. HF module: `layers.i` (`norm`, `mixer`)."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer_type = cfg.layer_types[layer]
        self.norm = NemotronHRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mixer: nn.Module
        if self.layer_type == MAMBA:
            self.mixer = Mamba2Mixer(cfg, layer)
        elif self.layer_type == FULL:
            self.mixer = Attention(cfg, layer, RMSNorm)  # no q/k norm, so the norm class is unused
        elif self.layer_type == MLP:
            self.mixer = NemotronHMLP(cfg)
        else:
            assert self.layer_type == MOE, self.layer_type
            self.mixer = NemotronHMoE(cfg)

    def forward(
        self,
        x: torch.Tensor,
        rope: dict[str, tuple[torch.Tensor, torch.Tensor]],
        masks: dict[str, torch.Tensor | str | None],
        cache: KVCache,
    ) -> torch.Tensor:
        h = self.norm(x)
        if self.layer_type == MAMBA:
            h = self.mixer(h, cache)
        elif self.layer_type == FULL:
            cos, sin = rope[FULL]  # NoPE: the attention ignores them (use_rope is False)
            h = self.mixer(h, cos, sin, masks[FULL], cache)
        else:
            h = self.mixer(h)
        return x + h


class NemotronH(CausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, NemotronHBlock, NemotronHRMSNorm)
