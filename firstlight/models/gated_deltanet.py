"""Gated DeltaNet: the linear-attention token mixer of Qwen3-Next and Qwen3.5 (Yang, Kautz & Hatamizadeh 2024,
"Gated Delta Networks: Improving Mamba2 with Delta Rule", arXiv:2412.06464).

Per value head, a state S [Dk, Dv] replaces the KV cache. For each token (q, k L2-normalized,
q scaled by Dk^-0.5, decay g <= 0 and write strength beta in (0, 1)):

    S <- exp(g) * S                       # gated forgetting
    S <- S + k (beta * (v - S^T k))^T     # delta rule: write only what S does not already predict
    o  = S^T q

Decode runs that recurrence one token at a time (`recurrent_step`). Prefill runs it chunk-parallel
(`chunked_delta_rule`): within a chunk of C tokens, the C sequential rank-1 updates are condensed
by the WY/UT representation into one unit-lower-triangular solve and a few matmuls (DeltaNet paper,
Yang et al. 2024, sec. 3.2), and only the chunk-to-chunk state hand-off stays sequential.

Before the mixer, q/k/v pass a causal depthwise conv (kernel K) with SiLU; its state is the last
K-1 inputs. After it, a gated RMSNorm: norm(o) * silu(z). Both states (conv, S) live in the cache
(`get_state` / `set_state`, see kv_cache.py), so a prefill may run in chunks and resume anywhere.
A cache with `keep_token_states` (the engine's speculative verify pass) also gets the states after
every token of the pass (`set_token_states`), so rejected proposals can be rolled back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from firstlight.models.config import ModelConfig
from firstlight.models.kv_cache import KVCache

CHUNK = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunked_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k: [B, H, S, Dk]; v: [B, H, S, Dv]; g, beta: [B, H, S]; state: [B, H, Dk, Dv] (all fp32,
    q/k normalized and q scaled) → (o [B, H, S, Dv], final state)."""
    batch, heads, seq, dk = k.shape
    dv = v.shape[-1]
    pad = (-seq) % chunk  # zero-padded tail tokens: g = 0, beta = 0 leave the state unchanged
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    n = (seq + pad) // chunk
    q, k, v = (t.reshape(batch, heads, n, chunk, -1) for t in (q, k, v))  # [B, H, N, C, D]
    g, beta = (t.reshape(batch, heads, n, chunk) for t in (g, beta))

    cum = g.cumsum(-1)  # log decay from the chunk start to each token: [B, H, N, C]
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # decay[i, j] = exp(cum_i - cum_j) for j <= i, else 0 (masked before exp, so no overflow)
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~lower, float("-inf")).exp()
    k_beta = k * beta.unsqueeze(-1)
    # UT transform: T = (I + strictly_lower(beta k k^T * decay))^-1 folds the chunk's sequential
    # delta-rule writes into  u = T (beta v)  and  w = T (beta exp(cum) k)  (DeltaNet, eq. 7-8)
    system = (k_beta @ k.transpose(-1, -2)) * decay  # [B, H, N, C, C], diagonal unused (unitriangular)
    u = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * cum.exp().unsqueeze(-1), upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay  # causal intra-chunk scores, diagonal included
    q_decayed = q * cum.exp().unsqueeze(-1)  # reads the state as decayed up to each token
    k_to_end = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)  # a write's decay until the chunk end
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [B, H, N, 1, 1]

    # outputs collected and stacked (no preallocated buffer: every op's output is a defined value,
    # which op-level verification compares)
    outs = []
    for i in range(n):  # the sequential part: one state hand-off per chunk
        v_new = u[:, :, i] - w[:, :, i] @ state  # what the state does not predict yet: [B, H, C, Dv]
        outs.append(q_decayed[:, :, i] @ state + attn[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ v_new
    return torch.stack(outs, dim=2).reshape(batch, heads, n * chunk, dv)[:, :, :seq], state


def recurrent_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence token by token (decode: S = 1). Same shapes as `chunked_delta_rule`."""
    out, state, _ = _recurrence(q, k, v, g, beta, state, keep_states=False)
    return out, state


def recurrent_states(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence token by token, keeping the state after every token: (o [B, H, S, Dv],
    states [B, S, H, Dk, Dv]). A speculative verify pass keeps them so that the state after the last
    accepted proposal can be put back when later proposals are rejected."""
    out, _, states = _recurrence(q, k, v, g, beta, state, keep_states=True)
    return out, torch.stack(states, dim=1)


def _recurrence(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
    keep_states: bool,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    outs, states = [], []
    for t in range(q.shape[2]):
        state = state * g[:, :, t].exp()[..., None, None]
        predicted = (state * k[:, :, t].unsqueeze(-1)).sum(-2)  # S^T k: [B, H, Dv]
        delta = (v[:, :, t] - predicted) * beta[:, :, t].unsqueeze(-1)
        state = state + k[:, :, t].unsqueeze(-1) * delta.unsqueeze(-2)
        outs.append((state * q[:, :, t].unsqueeze(-1)).sum(-2))
        if keep_states:
            states.append(state)
    return torch.stack(outs, dim=2), state, states


class GatedRMSNorm(nn.Module):
    """RMSNorm(x) * weight * silu(gate), normalized in fp32 (Qwen3-Next's RMSNormGated)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x32.to(dtype) * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """The mixer: in-projections → causal conv → gated delta rule → gated norm → out-projection."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        la = cfg.linear_attn
        assert la is not None
        self.layer = layer
        self.num_k_heads, self.num_v_heads = la.num_k_heads, la.num_v_heads
        self.k_head_dim, self.v_head_dim = la.k_head_dim, la.v_head_dim
        self.key_dim, self.value_dim = la.num_k_heads * la.k_head_dim, la.num_v_heads * la.v_head_dim
        self.ratio = la.num_v_heads // la.num_k_heads  # value heads per key head
        self.conv_kernel = la.conv_kernel
        self.grouped = la.grouped_in_proj
        if self.grouped:  # Qwen3-Next, grouped per key head: [q (Dk), k (Dk), v (r*Dv), z (r*Dv)] and [b (r), a (r)]
            self.in_proj_qkvz = nn.Linear(cfg.hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False)
            self.in_proj_ba = nn.Linear(cfg.hidden_size, 2 * la.num_v_heads, bias=False)
        else:  # Qwen3.5: HF's in_proj_{qkv,z,b,a} stacked, one matmul: [q | k | v | z | b | a], each all heads
            self.in_proj = nn.Linear(cfg.hidden_size, la.conv_dim + self.value_dim + 2 * la.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(la.conv_dim, la.conv_dim, la.conv_kernel, groups=la.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(la.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(la.num_v_heads))
        self.norm = GatedRMSNorm(la.v_head_dim, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, cfg.hidden_size, bias=False)

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [B, S, E] → mixed q|k|v [B, S, conv_dim], z [B, S, Hv, Dv], b, a [B, S, Hv]."""
        batch, seq, _ = x.shape
        dk, dv, r, hv = self.k_head_dim, self.v_head_dim, self.ratio, self.num_v_heads
        if not self.grouped:
            mixed, z, b, a = self.in_proj(x).split([2 * self.key_dim + self.value_dim, self.value_dim, hv, hv], dim=-1)
            return mixed, z.reshape(batch, seq, hv, dv), b, a
        qkvz = self.in_proj_qkvz(x).view(batch, seq, self.num_k_heads, 2 * dk + 2 * r * dv)
        q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], dim=-1)
        b, a = self.in_proj_ba(x).view(batch, seq, self.num_k_heads, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat([t.reshape(batch, seq, -1) for t in (q, k, v)], dim=-1)
        return mixed, z.reshape(batch, seq, hv, dv), b.reshape(batch, seq, hv), a.reshape(batch, seq, hv)

    def _conv(self, mixed: torch.Tensor, conv_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal depthwise conv + SiLU over [B, S, C] after the K-1 carried inputs [B, C, K-1]
        → (output [B, S, C], the inputs carried on: [B, C, K-1+S], the last K-1 of them the new state)."""
        x = torch.cat([conv_state, mixed.transpose(1, 2).to(conv_state.dtype)], dim=-1)  # [B, C, K-1+S]
        out = F.conv1d(x, self.conv1d.weight, groups=x.shape[1])  # [B, C, S]
        return F.silu(out).transpose(1, 2).to(mixed.dtype), x

    def forward(self, x: torch.Tensor, cache: KVCache) -> torch.Tensor:
        batch, seq, _ = x.shape  # x: [B, S, E]
        mixed, z, b, a = self._split(x)
        state = cache.get_state(self.layer)
        if state is None:  # a fresh sequence: zero conv inputs before it, zero delta-rule state
            conv_state = mixed.new_zeros(batch, mixed.shape[-1], self.conv_kernel - 1)
            rec_state = x.new_zeros(batch, self.num_v_heads, self.k_head_dim, self.v_head_dim, dtype=torch.float32)
        else:
            conv_state, rec_state = state
        mixed, conv_inputs = self._conv(mixed, conv_state)
        conv_state = conv_inputs[:, :, seq:]  # the last K-1 inputs: [B, C, K-1]
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(batch, seq, self.num_k_heads, self.k_head_dim)
        k = k.reshape(batch, seq, self.num_k_heads, self.k_head_dim)
        v = v.reshape(batch, seq, self.num_v_heads, self.v_head_dim)
        if self.ratio > 1:  # each key head serves `ratio` consecutive value heads
            q, k = q.repeat_interleave(self.ratio, dim=2), k.repeat_interleave(self.ratio, dim=2)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # log decay <= 0
        # fp32 throughout the recurrence; heads first: [B, H, S, D]
        q, k, v, g, beta = (t.transpose(1, 2).float() for t in (q, k, v, g, beta))
        q, k = l2norm(q), l2norm(k)
        q = q * self.k_head_dim**-0.5
        if seq > 1 and getattr(cache, "keep_token_states", False):
            # a speculative verify pass: keep the state after every token (rollback to any prefix)
            out, rec_states = recurrent_states(q, k, v, g, beta, rec_state.float())
            rec_state = rec_states[:, -1]
            conv_states = conv_inputs.unfold(-1, self.conv_kernel - 1, 1)[:, :, 1:]  # [B, C, S, K-1]
            cache.set_token_states(self.layer, conv_states.transpose(1, 2), rec_states)
        else:
            rule = recurrent_step if seq == 1 else chunked_delta_rule
            out, rec_state = rule(q, k, v, g, beta, rec_state.float())
        cache.set_state(self.layer, conv_state, rec_state)
        out = out.transpose(1, 2).to(x.dtype)  # [B, S, Hv, Dv]
        out = self.norm(out, z).reshape(batch, seq, self.value_dim)
        return self.out_proj(out)
