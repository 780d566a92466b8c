"""Mamba-2: the selective state-space token mixer of Granite 4.0-H and Nemotron-H (Dao & Gu 2024,
"Transformers are SSMs: Generalized Models and Efficient Algorithms Through Structured State Space
Duality", arXiv:2405.21060).

Per head h (P = head_dim channels, N = state_size), a state S [P, N] replaces the KV cache. For each
token, with step dt > 0 (softplus of a projection, clamped to time_step_limit), scalar A_h < 0, and
B, C [N] shared by the heads of a group:

    S <- exp(dt * A_h) * S + dt * x B^T     # decay, then write x along B
    y  = S C + D_h * x                      # read along C, plus a skip

Decode runs that recurrence token by token (`ssd_recurrent`). Prefill runs it chunk-parallel
(`ssd_chunked`, the SSD algorithm, paper sec. 6): within a chunk of C tokens the output is a masked
"attention" y = (L * C B^T) (dt x) with L[i, j] = exp(sum of dt*A over j+1..i), plus the read of the
state entering the chunk; only the chunk-to-chunk state hand-off stays sequential.

Around the scan: in_proj yields [gate z (I), x|B|C (conv_dim), dt (H)]; x|B|C pass a causal depthwise
conv (kernel K, with bias) and SiLU, whose state is the last K-1 inputs; after the scan a gated RMSNorm
normalizes y * silu(z) per group (norm_before_gate=False), then out_proj. Both states (conv, S) live in
the cache (`get_state` / `set_state`, see kv_cache.py), exactly as Gated DeltaNet's do, so a prefill may
run in chunks and the engine's state slots hold them unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from firstlight.models.config import Mamba2Config, ModelConfig
from firstlight.models.kv_cache import KVCache
from firstlight.models.layers import ACTIVATIONS

CHUNK = 64


def ssd_chunked(
    x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
    state: torch.Tensor, chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [B, H, S, P]; dt: [B, H, S] (after softplus); a: [H] (< 0); b, c: [B, H, S, N] (groups already
    repeated per head); state: [B, H, P, N] (all fp32) → (y [B, H, S, P] without the D skip, final state)."""
    batch, heads, seq, p = x.shape
    pad = (-seq) % chunk  # zero-padded tail tokens: dt = 0 leaves the state unchanged (no decay, no write)
    if pad:
        x, b, c = (F.pad(t, (0, 0, 0, pad)) for t in (x, b, c))
        dt = F.pad(dt, (0, pad))
    n = (seq + pad) // chunk
    x, b, c = (t.reshape(batch, heads, n, chunk, -1) for t in (x, b, c))  # [B, H, Nc, C, D]
    dt = dt.reshape(batch, heads, n, chunk)

    cum = (dt * a[:, None, None]).cumsum(-1)  # log decay from the chunk start to each token: [B, H, Nc, C]
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()
    # decay[i, j] = exp(cum_i - cum_j) for j <= i, else 0 (masked before exp, so no overflow)
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~lower, float("-inf")).exp()
    x_dt = x * dt.unsqueeze(-1)  # the input as written: dt * x
    scores = (c @ b.transpose(-1, -2)) * decay  # [B, H, Nc, C, C], causal
    y_intra = scores @ x_dt  # [B, H, Nc, C, P]
    c_decayed = c * cum.exp().unsqueeze(-1)  # reads the entering state as decayed up to each token
    x_to_end = x_dt * (cum[..., -1:] - cum).exp().unsqueeze(-1)  # a write's decay until the chunk end
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [B, H, Nc, 1, 1]

    outs = []
    for i in range(n):  # the sequential part: one state hand-off per chunk
        outs.append(y_intra[:, :, i] + c_decayed[:, :, i] @ state.transpose(-1, -2))  # [B, H, C, P]
        state = state * chunk_decay[:, :, i] + x_to_end[:, :, i].transpose(-1, -2) @ b[:, :, i]  # [B, H, P, N]
    return torch.stack(outs, dim=2).reshape(batch, heads, n * chunk, p)[:, :, :seq], state


def ssd_recurrent(
    x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence token by token (decode: S = 1). Same shapes as `ssd_chunked`."""
    y, states = ssd_token_states(x, dt, a, b, c, state)
    return y, states[:, -1]


def ssd_token_states(
    x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence token by token, keeping the state after every token: (y [B, H, S, P], states
    [B, S, H, P, N]); a speculative verify pass rolls back to any of them."""
    outs, states = [], []
    for t in range(x.shape[2]):
        step = dt[:, :, t, None, None]  # [B, H, 1, 1]
        state = state * (step * a[:, None, None]).exp() + step * x[:, :, t, :, None] * b[:, :, t, None, :]
        outs.append((state * c[:, :, t, None, :]).sum(-1))  # S C: [B, H, P]
        states.append(state)
    return torch.stack(outs, dim=2), torch.stack(states, dim=1)


class GroupedGatedRMSNorm(nn.Module):
    """RMSNorm(x * silu(gate)) over groups of `group_size` channels, then * weight, in fp32 (HF's
    GraniteMoeHybridRMSNormGated with norm_before_gate=False: the gate is applied before normalizing)."""

    def __init__(self, dim: int, group_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.group_size, self.eps = group_size, eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float() * F.silu(gate.float())
        grouped = x32.unflatten(-1, (-1, self.group_size))  # [..., G, I/G]
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * grouped.flatten(-2).to(dtype)


class Mamba2Mixer(nn.Module):
    """in_proj → causal conv over x|B|C → SSD scan → gated group RMSNorm → out_proj. HF module: `mamba`."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        m = cfg.mamba
        assert m is not None
        self.layer = layer
        self.num_heads, self.head_dim, self.num_groups, self.state_size = (
            m.num_heads, m.head_dim, m.num_groups, m.state_size
        )
        self.intermediate, self.conv_dim, self.conv_kernel = m.intermediate_size, m.conv_dim, m.conv_kernel
        self.dt_min, self.dt_max = m.time_step_min, m.time_step_max
        self.act = ACTIVATIONS[m.activation]  # after the conv (silu)
        self.in_proj = nn.Linear(cfg.hidden_size, self.intermediate + self.conv_dim + self.num_heads, bias=m.proj_bias)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, m.conv_kernel, groups=self.conv_dim, bias=m.conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(self.num_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_heads))
        self.D = nn.Parameter(torch.ones(self.num_heads))
        self.norm = GroupedGatedRMSNorm(self.intermediate, self.intermediate // self.num_groups, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.intermediate, cfg.hidden_size, bias=m.proj_bias)

    @staticmethod
    def state_shapes(m: Mamba2Config) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One request's states: conv inputs [conv_dim, K-1] (model dtype), SSM state [H, P, N] (fp32)."""
        return (m.conv_dim, m.conv_kernel - 1), (m.num_heads, m.head_dim, m.state_size)

    def _conv(self, xbc: torch.Tensor, conv_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal depthwise conv + activation over [B, S, C] after the K-1 carried inputs [B, C, K-1];
        also the inputs it read, [B, C, K-1+S] (the last K-1 are the next conv state)."""
        x = torch.cat([conv_state, xbc.transpose(1, 2).to(conv_state.dtype)], dim=-1)  # [B, C, K-1+S]
        out = F.conv1d(x, self.conv1d.weight, self.conv1d.bias, groups=self.conv_dim)  # [B, C, S]
        return self.act(out).transpose(1, 2).to(xbc.dtype), x

    def forward(self, hidden: torch.Tensor, cache: KVCache) -> torch.Tensor:
        batch, seq, _ = hidden.shape  # hidden: [B, S, E]
        gate, xbc, dt = self.in_proj(hidden).split([self.intermediate, self.conv_dim, self.num_heads], dim=-1)
        state = cache.get_state(self.layer)
        if state is None:  # a fresh sequence: zero conv inputs before it, zero SSM state
            conv_state = xbc.new_zeros(batch, self.conv_dim, self.conv_kernel - 1)
            ssm_state = hidden.new_zeros(batch, self.num_heads, self.head_dim, self.state_size, dtype=torch.float32)
        else:
            conv_state, ssm_state = state
        xbc, conv_inputs = self._conv(xbc, conv_state)
        conv_state = conv_inputs[:, :, conv_inputs.shape[-1] - (self.conv_kernel - 1):]
        gn = self.num_groups * self.state_size
        x, b, c = xbc.split([self.intermediate, gn, gn], dim=-1)
        heads_per_group = self.num_heads // self.num_groups
        # fp32 throughout the scan; heads first: x [B, H, S, P], b/c [B, H, S, N] (one group per heads_per_group)
        x = x.float().view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)
        b, c = (t.float().view(batch, seq, self.num_groups, self.state_size).transpose(1, 2)
                .repeat_interleave(heads_per_group, dim=1) for t in (b, c))
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(self.dt_min, self.dt_max).transpose(1, 2)  # [B, H, S]
        a = -self.A_log.float().exp()  # [H]
        if seq > 1 and getattr(cache, "keep_token_states", False):
            # a speculative verify pass: keep the states after every token (rollback to any prefix)
            y, ssm_states = ssd_token_states(x, dt, a, b, c, ssm_state.float())
            ssm_state = ssm_states[:, -1]
            conv_states = conv_inputs.unfold(-1, self.conv_kernel - 1, 1)[:, :, 1:]  # [B, C, S, K-1]
            cache.set_token_states(self.layer, conv_states.transpose(1, 2), ssm_states)
        else:
            scan = ssd_recurrent if seq == 1 else ssd_chunked
            y, ssm_state = scan(x, dt, a, b, c, ssm_state.float())
        cache.set_state(self.layer, conv_state, ssm_state)
        y = y + self.D.float()[:, None, None] * x  # the skip: [B, H, S, P]
        y = y.transpose(1, 2).reshape(batch, seq, self.intermediate)  # still fp32: HF normalizes before the cast
        return self.out_proj(self.norm(y, gate).to(hidden.dtype))
