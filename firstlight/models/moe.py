"""Sparse mixture-of-experts decoders: Mixtral, Qwen2-MoE (with a gated shared expert) and Qwen3-MoE.

    x = embed(ids)
    for each layer:  x = x + attn(norm(x));  x = x + moe(norm(x))      # moe: a dense MLP on some layers
    logits = lm_head(norm(x))

    moe(h) = sum over the top-k experts e of h's router:  w_e * expert_e(h)
             [+ sigmoid(shared_gate(h)) * shared_expert(h)]            # Qwen2-MoE, Qwen3-Next

The router is a linear map to one logit per expert; softmax (in fp32), top-k, then optionally
renormalized over the k (Mixtral always; Qwen per `norm_topk_prob`) — as transformers computes it
per family. Experts are dispatched grouped by expert: the (token, expert) pairs are sorted by expert
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


class Experts(nn.Module):
    """X gated MLPs with stacked weights, applied to the (token, expert) pairs a router picked."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe = cfg.moe
        assert moe is not None
        self.num_experts, self.intermediate = moe.num_experts, moe.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(moe.num_experts, 2 * moe.intermediate_size, cfg.hidden_size))
        self.down_proj = nn.Parameter(torch.empty(moe.num_experts, cfg.hidden_size, moe.intermediate_size))
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """x: [T, E]; weights, experts: [T, k] → sum_k weights * expert(x): [T, E]."""
        num_tokens, top_k = experts.shape
        flat = experts.reshape(-1)  # [T*k]
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert, in token order within one
        token = order // top_k  # [N] the token of each sorted pair (N = T*k)
        rows = x[token]  # [N, E]
        if torch.compiler.is_compiling():
            # grouped_mm has no fp32 lowering in inductor: every expert on every pair, masked
            # (static shapes; X times the compute, fine for decode-sized batches)
            h = torch.einsum("ne,xfe->nxf", rows, self.gate_up_proj)
            h = h.gather(1, flat[order].view(-1, 1, 1).expand(-1, 1, h.shape[-1])).squeeze(1)
            gate, up = h.split(self.intermediate, dim=-1)
            out = torch.einsum("ni,xei->nxe", self.act(gate) * up, self.down_proj)
            out = out.gather(1, flat[order].view(-1, 1, 1).expand(-1, 1, out.shape[-1])).squeeze(1)
        else:
            counts = torch.bincount(flat, minlength=self.num_experts)
            offsets = counts.cumsum(0).to(torch.int32)  # end row of each expert's group
            h = F.grouped_mm(rows, self.gate_up_proj.transpose(1, 2), offs=offsets)  # [N, 2I]
            gate, up = h.split(self.intermediate, dim=-1)
            out = F.grouped_mm(self.act(gate) * up, self.down_proj.transpose(1, 2), offs=offsets)  # [N, E]
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
