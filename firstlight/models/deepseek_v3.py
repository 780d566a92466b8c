"""DeepSeek-V3 (`deepseek_v3`, DeepSeek-AI 2024, arXiv:2412.19437): Multi-head Latent Attention, dense MLPs
in the first `first_k_dense_replace` layers and mixtures of experts after them.

    x = embed(ids)
    for each layer:  x = x + mla(norm(x));  x = x + ffn(norm(x))     # ffn: GatedMLP, or routed + shared experts
    logits = lm_head(norm(x))

MLA (DeepSeek-V2, arXiv:2405.04434, sec. 2.1). Per token, one latent c = norm(W_DKV x) [r = kv_lora_rank]
and one rope key k_r = rope(W_KR x) [Dr = qk_rope_head_dim] shared by all heads; per head h,
k_h = [W_UK_h c | k_r], v_h = W_UV_h c (W_UK, W_UV: the two halves of `kv_b_proj`), and
q_h = [q_nope_h | rope(q_rope_h)] from `q_proj` or through a low-rank bottleneck (`q_a_proj`, norm,
`q_b_proj`). Scores use 1/sqrt(Dn + Dr), times YaRN's mscale squared (config.py `_mla_scale`).

We run it "absorbed" (sec. 2.1.2 of the V2 paper): q_nope_h . W_UK_h c = (W_UK_h^T q_nope_h) . c and
sum_j p_j W_UV_h c_j = W_UV_h sum_j p_j c_j, so every head attends over the latent rows themselves,
keys [c | k_r] (r + Dr wide) and values c, one shared "KV head" (MQA), and the cache keeps only that row:
r + Dr values per token and layer (576 for V3, against 2 x 128 heads x 192 decompressed). The KV-cache
protocol (kv_cache.py) stores a K and a V tensor of one width, so the row is stored split in two halves,
its first half as "K" and its second as "V" (ModelConfig: num_kv_heads 1, head_dim (r + Dr) / 2); every
cache (contiguous, the engine's paged pools, quantized) keeps it unchanged. The attention itself is
the same SDPA call as every family's. transformers caches the same row, as (c, k_r): see
`kv_from_reference`.

With `rope_interleave` (V3's checkpoints) the rope dims of q and k come as interleaved pairs (x0, x1),
(x2, x3), ...; they are de-interleaved to the half-split layout before the rotation, as transformers'
`apply_rotary_pos_emb_interleave` does. Routing is moe.py's SigmoidGroupRouter; expert weights are stacked
as in transformers (hf_names.py reads the checkpoint's one tensor per expert).

MTP (V3 report sec. 2.2; vLLM's deepseek_mtp.py): the files keep each multi-token-prediction depth k as
`model.layers.{num_hidden_layers + k}`: a MoE decoder layer's own weights beside `enorm`, `hnorm`,
`eh_proj` and `shared_head.norm`. At position p, from the target's final (normed) hidden state h_p and
the token after it:

    x_p = layer(eh_proj([enorm(embed(t_{p+1})), hnorm(h_p)]))      # its own latent KV at p
    logits(t_{p+2}) = lm_head(shared_head.norm(x_p))

The embedding and the output head are the main model's (shared, as the report and DeepSeek's weight notes
say); the copies the files keep (`embed_tokens`, `shared_head.head` of that layer) are not read.
transformers skips the whole layer on load; our `mtp` holds it (hf_names.py maps `mtp.{i}.*` to
`model.layers.{i}.*`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from firstlight.models.config import FULL, ModelConfig
from firstlight.models.kv_cache import KVCache
from firstlight.models.layers import GatedMLP, MTPCausalLM, RMSNorm, apply_rope
from firstlight.models.moe import Experts, SigmoidGroupRouter

LORA_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm: transformers builds them with the default eps


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., (x0, x1), (x2, x3), ...] → [..., x0, x2, ..., x1, x3, ...] (the half-split rope layout)."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class MLAttention(nn.Module):
    """Multi-head Latent Attention, absorbed (module docstring). HF module: `self_attn`."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        mla = cfg.mla
        assert mla is not None
        self.layer = layer
        self.num_heads, self.rank, self.interleave = cfg.num_heads, mla.kv_lora_rank, mla.rope_interleave
        self.nope_dim, self.rope_dim, self.v_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        self.scale = cfg.attn_scale
        q_out = cfg.num_heads * mla.qk_head_dim
        self.q_proj = self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(cfg.hidden_size, q_out, bias=False)
        else:
            self.q_a_proj = nn.Linear(cfg.hidden_size, mla.q_lora_rank, bias=cfg.qkv_bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, mla.cache_width, bias=cfg.qkv_bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LORA_NORM_EPS)
        self.kv_b_proj = nn.Linear(mla.kv_lora_rank, cfg.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * mla.v_head_dim, cfg.hidden_size, bias=cfg.o_bias)

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if self.q_proj is not None:
            return self.q_proj(x)
        assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | str | None,
        cache: KVCache,
    ) -> torch.Tensor:
        batch, seq, _ = x.shape  # x: [B, S, E]
        q = self._query(x).view(batch, seq, self.num_heads, -1).transpose(1, 2)  # q: [B, H, S, Dn + Dr]
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent).unsqueeze(1)  # c: [B, 1, S, r]
        k_rope = k_rope.unsqueeze(1)  # [B, 1, S, Dr]
        if self.interleave:
            q_rope, k_rope = deinterleave(q_rope), deinterleave(k_rope)
        q_rope, k_rope = apply_rope(q_rope, cos, sin), apply_rope(k_rope, cos, sin)
        k_half, v_half = torch.cat((latent, k_rope), dim=-1).chunk(2, dim=-1)  # the cached row, in two halves
        k_half, v_half = cache.update(self.layer, k_half, v_half)
        keys = torch.cat((k_half, v_half), dim=-1)  # [B, 1, L, r + Dr]: [c | k_r] of every key
        w_uk, w_uv = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.rank).split(
            [self.nope_dim, self.v_dim], dim=1)  # [H, Dn, r], [H, Dv, r]
        q = torch.cat((q_nope @ w_uk, q_rope), dim=-1)  # [B, H, S, r + Dr]: q_nope absorbed into latent space
        causal = isinstance(mask, str)
        out = F.scaled_dot_product_attention(
            q, keys, keys[..., : self.rank], attn_mask=None if causal else mask, is_causal=causal, scale=self.scale,
            enable_gqa=True,
        )  # out: [B, H, S, r], a mix of latents
        out = out @ w_uv.transpose(1, 2)  # [B, H, S, Dv]
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, self.num_heads * self.v_dim))


class DeepseekV3MoE(nn.Module):
    """Routed experts (DeepSeek-V3 routing) + always-on shared experts (one MLP, n_shared_experts wide).
    HF module: `mlp` (`gate`, `experts`, `shared_experts`)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe = cfg.moe
        assert moe is not None
        self.gate = SigmoidGroupRouter(cfg)
        self.experts = Experts(cfg)
        shared = moe.shared_expert_intermediate_size
        self.shared_experts = GatedMLP(cfg, shared) if shared else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        shape = h.shape  # [B, S, E]: every token of every row is routed together
        x = h.reshape(-1, shape[-1])  # [T, E]
        weights, experts = self.gate(x)
        out = self.experts(x, weights, experts)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.view(shape)


class DeepseekV3Layer(nn.Module):
    """x + mla(norm(x)), then + ffn(norm(x)); `sparse` picks the FFN (default: the config's layer pattern)."""

    def __init__(self, cfg: ModelConfig, layer: int, sparse: bool | None = None) -> None:
        super().__init__()
        assert cfg.moe is not None
        self.layer_type = FULL
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAttention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        sparse = cfg.moe.sparse_layers[layer] if sparse is None else sparse
        self.mlp: nn.Module = DeepseekV3MoE(cfg) if sparse else GatedMLP(cfg)

    def forward(
        self,
        x: torch.Tensor,
        rope: dict[str, tuple[torch.Tensor, torch.Tensor]],
        masks: dict[str, torch.Tensor | str | None],
        cache: KVCache,
    ) -> torch.Tensor:
        cos, sin = rope[FULL]
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, masks[FULL], cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class SharedHead(nn.Module):
    """An MTP depth's `shared_head`: its final norm (its `head` is the main LM head, shared)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekV3MTPLayer(DeepseekV3Layer):
    """One MTP depth (module docstring): a MoE decoder layer caching as layer `layer` (>= num_layers),
    with the projection of [enorm(embedding) | hnorm(hidden)] in front and `shared_head.norm` behind."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__(cfg, layer, sparse=True)  # as every V3 layer past first_k_dense_replace
        e, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm = RMSNorm(e, eps)
        self.hnorm = RMSNorm(e, eps)
        self.eh_proj = nn.Linear(2 * e, e, bias=False)
        self.shared_head = SharedHead(cfg)

    def predict(
        self,
        hidden: torch.Tensor,
        embeds: torch.Tensor,
        rope: dict[str, tuple[torch.Tensor, torch.Tensor]],
        masks: dict[str, torch.Tensor | str | None],
        cache: KVCache,
    ) -> torch.Tensor:
        """shared_head.norm(layer(eh_proj([enorm(embeds), hnorm(hidden)]))): [B, S, E]."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        return self.shared_head.norm(self(x, rope, masks, cache))


class DeepseekV3MTP(nn.ModuleDict):
    """The MTP depths, keyed by their layer index in the files (num_layers + k), as vLLM keys them."""

    def __init__(self, cfg: ModelConfig) -> None:
        first = cfg.num_layers
        super().__init__({str(first + k): DeepseekV3MTPLayer(cfg, first + k) for k in range(cfg.num_mtp_layers)})
        self.first = first

    def depth(self, step: int) -> DeepseekV3MTPLayer:
        """The depth that MTP step `step` runs: step mod their count."""
        layer = self[str(self.first + step % len(self))]
        assert isinstance(layer, DeepseekV3MTPLayer)
        return layer

    def forward(
        self,
        hidden: torch.Tensor,
        embeds: torch.Tensor,
        rope: dict[str, tuple[torch.Tensor, torch.Tensor]],
        masks: dict[str, torch.Tensor | str | None],
        cache: KVCache,
        step: int = 0,
    ) -> torch.Tensor:
        """The step's depth over hidden [B, S, E] and the next tokens' embeddings [B, S, E] → [B, S, E]."""
        return self.depth(step).predict(hidden, embeds, rope, masks, cache)

    def step_modules(self, step: int = 0) -> tuple[nn.Module, ...]:
        """What one MTP step reads besides the LM head: its depth (decoder layer and projection)."""
        return (self.depth(step),)


class DeepseekV3(MTPCausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, DeepseekV3Layer, RMSNorm)
        self.mtp = DeepseekV3MTP(cfg) if cfg.num_mtp_layers else None

    @staticmethod
    def kv_from_reference(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' cache entries of one layer (keys: the normed latents [B, 1, L, r], values: the
        rotated rope keys [B, 1, L, Dr]) → what ours caches: the row [c | k_r], split in halves."""
        k_half, v_half = torch.cat((keys, values), dim=-1).chunk(2, dim=-1)
        return k_half, v_half
