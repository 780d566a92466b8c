"""Sparse mixture-of-experts decoders: Mixtral, Qwen2-MoE (with a gated shared expert) and Qwen3-MoE.

    x = embed(ids)
    for each layer:  x = x + attn(norm(x));  x = x + moe(norm(x))      # moe: a dense MLP on some layers
    logits = lm_head(norm(x))

    moe(h) = sum over the top-k experts e of h's router:  w_e * expert_e(h)
             [+ sigmoid(shared_gate(h)) * shared_expert(h)]            # Qwen2-MoE, Qwen3-Next

The router is a linear map to one logit per expert; softmax (in fp32), top-k, then optionally
renormalized over the k (Mixtral always; Qwen per `norm_topk_prob`) — as transformers computes it
per family. `SigmoidGroupRouter` is DeepSeek-V3's (Nemotron-H's): sigmoid scores, the top-k chosen by
score + a per-expert correction bias within the best expert groups, weighted by the plain scores. Experts are dispatched grouped by expert: the (token, expert) pairs are sorted by expert
and each expert's rows go through one matmul of a grouped GEMM (`torch.nn.functional.grouped_mm`),
so there is no Python loop over tokens or experts. Expert weights are stacked as transformers keeps
them in memory ([X, 2I, E] gate+up, [X, E, I] down); the loader stacks the per-expert tensors of
the checkpoint files (hf_names.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from firstlight.models.config import ModelConfig
from firstlight.models.dense import DecoderLayer
from firstlight.models.layers import ACTIVATIONS, CausalLM, GatedMLP, RMSNorm


class Router(nn.Module):
    """Token → (top-k routing weights [T, k], expert ids [T, k])."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe = cfg.moe
        assert moe is not None
        self.top_k, self.norm_topk_prob, self.fp32_weights = (
            moe.num_experts_per_tok, moe.norm_topk_prob, moe.fp32_routing_weights
        )
        self.weight = nn.Parameter(torch.empty(moe.num_experts, cfg.hidden_size))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight)  # [T, X]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.fp32_weights:
            weights = weights.to(logits.dtype)
        return weights, experts


class SigmoidGroupRouter(nn.Module):
    """DeepSeek-V3 routing (DeepSeek-AI 2024, arXiv:2412.19437, sec. 2.1.2), as transformers'
    DeepseekV3TopkRouter: token → (top-k weights [T, k] in fp32, expert ids [T, k]).

    scores = sigmoid(x W^T) (fp32). The choice adds the load-balancing bias (`e_score_correction_bias`)
    and keeps only the `topk_groups` expert groups whose two best biased scores sum highest; the weights
    are the unbiased scores of the chosen experts, renormalized (norm_topk_prob), times
    routed_scaling_factor."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe = cfg.moe
        assert moe is not None
        self.top_k, self.norm_topk_prob, self.scale = moe.num_experts_per_tok, moe.norm_topk_prob, moe.routed_scaling_factor
        self.num_groups, self.topk_groups = moe.num_groups, moe.topk_groups
        self.weight = nn.Parameter(torch.empty(moe.num_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(moe.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [T, X]
        choice = scores + self.e_score_correction_bias.float()
        if self.topk_groups < self.num_groups:
            grouped = choice.unflatten(-1, (self.num_groups, -1))  # [T, G, X/G]
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [T, G]
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(
                1, group_scores.topk(self.topk_groups, dim=-1).indices, True)
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).flatten(-2)
        experts = choice.topk(self.top_k, dim=-1).indices  # [T, k]
        weights = scores.gather(1, experts)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scale, experts


class Experts(nn.Module):
    """X MLPs with stacked weights, applied to the (token, expert) pairs a router picked: gated
    (down(act(gate) * up), gate|up stacked as `gate_up_proj`) or, with `gated_experts` False, down(act(up))
    (`up_proj`, Nemotron-H). They work in the MoE's latent width when it has one."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe = cfg.moe
        assert moe is not None
        self.num_experts, self.intermediate, self.gated = moe.num_experts, moe.intermediate_size, moe.gated_experts
        dim = moe.latent_size or cfg.hidden_size
        if self.gated:
            self.gate_up_proj = nn.Parameter(torch.empty(moe.num_experts, 2 * moe.intermediate_size, dim))
        else:
            self.up_proj = nn.Parameter(torch.empty(moe.num_experts, moe.intermediate_size, dim))
        self.down_proj = nn.Parameter(torch.empty(moe.num_experts, dim, moe.intermediate_size))
        self.act = ACTIVATIONS[cfg.hidden_act]

    def _hidden(self, h: torch.Tensor) -> torch.Tensor:
        """The first projection's output [N, 2I] or [N, I] → the down projection's input [N, I]."""
        if not self.gated:
            return self.act(h)
        gate, up = h.split(self.intermediate, dim=-1)
        return self.act(gate) * up

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """x: [T, E]; weights, experts: [T, k] → sum_k weights * expert(x): [T, E]."""
        num_tokens, top_k = experts.shape
        flat = experts.reshape(-1)  # [T*k]
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert, in token order within one
        token = order // top_k  # [N] the token of each sorted pair (N = T*k)
        rows = x[token]  # [N, E]
        w_in = self.gate_up_proj if self.gated else self.up_proj
        if torch.compiler.is_compiling():
            # grouped_mm has no fp32 lowering in inductor: every expert on every pair, masked
            # (static shapes; X times the compute, fine for decode-sized batches)
            h = torch.einsum("ne,xfe->nxf", rows, w_in)
            h = h.gather(1, flat[order].view(-1, 1, 1).expand(-1, 1, h.shape[-1])).squeeze(1)
            out = torch.einsum("ni,xei->nxe", self._hidden(h), self.down_proj)
            out = out.gather(1, flat[order].view(-1, 1, 1).expand(-1, 1, out.shape[-1])).squeeze(1)
        else:
            counts = torch.bincount(flat, minlength=self.num_experts)
            offsets = counts.cumsum(0).to(torch.int32)  # end row of each expert's group
            h = F.grouped_mm(rows, w_in.transpose(1, 2), offs=offsets)  # [N, 2I] (gated) or [N, I]
            out = F.grouped_mm(self._hidden(h), self.down_proj.transpose(1, 2), offs=offsets)  # [N, E]
        out = out * weights.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add_(0, token, out.to(x.dtype))


class SparseMoE(nn.Module):
    """Router + experts (+ a shared expert behind a sigmoid gate). HF module: `mlp`."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe = cfg.moe
        assert moe is not None
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        self.shared_expert = None
        self.shared_expert_gate = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(cfg, moe.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        shape = h.shape  # [B, S, E]: every token of every row is routed together
        x = h.reshape(-1, shape[-1])  # [T, E]
        weights, experts = self.gate(x)
        out = self.experts(x, weights, experts)
        if self.shared_expert is not None:
            assert self.shared_expert_gate is not None
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.view(shape)


def mlp_for_layer(cfg: ModelConfig, layer: int) -> nn.Module:
    """The layer's MoE block, or a dense MLP where the family's config makes the layer dense."""
    moe = cfg.moe
    if moe is not None and moe.sparse_layers[layer]:
        return SparseMoE(cfg)
    return GatedMLP(cfg)


class MoEDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__(cfg, layer)
        self.mlp = mlp_for_layer(cfg, layer)


class MoEDecoder(CausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, MoEDecoderLayer, RMSNorm)
