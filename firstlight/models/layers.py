"""Building blocks shared by the model families: norms, rotary embedding, masks, attention, MLP.

Shapes: B batch rows, S new tokens per row, L keys per row (cache + new), H query heads,
Hkv key/value heads, D head dim, E hidden size.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from firstlight.models.config import ModelConfig, RopeConfig
from firstlight.models.kv_cache import KVCache, NoCache

ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "relu2": lambda x: F.relu(x).square(),  # squared ReLU (So et al. 2021, "Primer"), Nemotron-H's MLPs
}


class RMSNorm(nn.Module):
    """Llama-style RMSNorm: normalize in fp32, cast back, then scale by weight (Zhang & Sennrich 2019)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma RMSNorm: scale by (1 + weight), all in fp32, then cast back."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).type_as(x)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies [Dr/2] (Dr = the rotated dims), with Llama-3.1, linear or YaRN position
    scaling applied. Dynamic NTK's depend on the sequence length: see `dynamic_ntk_inv_freq`."""
    dim = rope.rotary_dim(head_dim)
    steps = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float()
    inv_freq = 1.0 / (rope.theta ** (steps / dim))
    if rope.kind == "linear":
        return inv_freq / rope.factor
    if rope.kind == "yarn":
        return _yarn_inv_freq(rope, dim)
    if rope.kind == "llama3":
        # Llama 3.1: low frequencies are divided by `factor`, high ones kept, a smooth blend between.
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


def _yarn_inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    """YaRN (Peng et al. 2023, "YaRN: Efficient Context Window Extension"): high frequencies kept
    (extrapolated), low ones divided by `factor` (interpolated), a linear ramp between the dims that
    turn beta_fast and beta_slow times over the original context. As transformers' `_compute_yarn_parameters`."""
    base, factor, orig = rope.theta, rope.factor, rope.original_max_position_embeddings

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    # explicit cpu: models are built under torch.device("meta"), and these are not parameters
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate


def dynamic_ntk_inv_freq(rope: RopeConfig, head_dim: int, positions: torch.Tensor) -> torch.Tensor:
    """Dynamic NTK scaling: per row, the base grows with the row's length once it passes the trained
    length, base' = base * (factor * len / orig - (factor - 1)) ^ (Dr / (Dr - 2)) (bloc97/emozilla, as
    transformers' `_compute_dynamic_ntk_parameters`, which takes len = the largest position + 1 of a
    forward). Returns [B, 1, Dr/2] for positions [B, S]. Each row scales by its own length, so a
    batched engine gives every request what it would get alone."""
    dim = rope.rotary_dim(head_dim)
    orig = rope.original_max_position_embeddings
    seq_len = (positions.amax(dim=-1, keepdim=True) + 1).clamp(min=orig).float()  # [B, 1]
    base = rope.theta * ((rope.factor * seq_len / orig) - (rope.factor - 1)) ** (dim / (dim - 2))
    steps = torch.arange(0, dim, 2, dtype=torch.int64, device=positions.device).float() / dim
    return 1.0 / (base.unsqueeze(-1) ** steps)  # [B, 1, Dr/2]


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [B, 1, S, Dr] for positions [B, S], computed in fp32 and cast to the model dtype.

    inv_freq: [Dr/2], or [B, 1, Dr/2] per row (dynamic NTK); `scale` multiplies both (YaRN)."""
    freqs = positions.float().unsqueeze(-1) * inv_freq  # [B, S, Dr/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [B, S, Dr]
    cos, sin = emb.cos(), emb.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, S, D] rotated by the (half-split, GPT-NeoX layout) rotary embedding; with partial
    rotary (cos: [.., Dr], Dr < D) only the first Dr dims rotate, the rest pass through."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)


CAUSAL = "causal"  # mask sentinel: plain causal attention over exactly the new tokens


def _is_plain_causal(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> bool:
    """True when the keys are exactly the queries, in order, with no padding and no window cut."""
    seq = q_pos.shape[1]
    return (
        seq > 1
        and k_pos.shape[1] == seq
        and (window is None or seq <= window)
        and torch.equal(q_pos, k_pos)
        and bool((q_pos[:, 0] >= 0).all())
        and bool((q_pos[:, 1:] > q_pos[:, :-1]).all())
    )


def attention_mask(
    q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None, allow_shortcuts: bool = True
) -> torch.Tensor | str | None:
    """Boolean mask [B, 1, S, L] (True = attend). With allow_shortcuts: None when every query may
    see every key, CAUSAL when the mask is exactly lower-triangular (SDPA's `is_causal` fast path).

    A key is visible when it exists (k_pos >= 0), is not in the future (k_pos <= q_pos) and, for a
    sliding-window layer, lies within the window (q_pos - k_pos < window). Padding queries
    (q_pos < 0) see everything, so their (discarded) rows stay finite.
    """
    # The shortcuts read tensor values: skip them while compiling, to keep the graph whole.
    eager = allow_shortcuts and not torch.compiler.is_compiling()
    if eager and _is_plain_causal(q_pos, k_pos, window):
        return CAUSAL
    q = q_pos.unsqueeze(-1)  # [B, S, 1]
    k = k_pos.unsqueeze(-2)  # [B, 1, L]
    allowed = (k >= 0) & (k <= q)
    if window is not None:
        allowed &= (q - k) < window
    allowed |= q < 0
    if eager and q_pos.shape[1] == 1 and bool(allowed.all()):
        return None  # decode with nothing masked: let SDPA take its unmasked path
    return allowed.unsqueeze(1)


class Attention(nn.Module):
    """Multi-head attention with grouped KV heads (GQA), fused QKV, optional per-head q/k norm."""

    def __init__(self, cfg: ModelConfig, layer: int, norm_cls: type[nn.Module]) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.attn_scale if cfg.attn_scale is not None else cfg.head_dim**-0.5
        # Qwen3-Next's gated attention: q_proj also yields a per-head output gate, [q_h | gate_h] per head
        self.output_gate = cfg.attn_output_gate
        self.q_proj_size = self.q_size * (2 if self.output_gate else 1)
        # One matmul for q, k and v: a decode step reads the weights once, in one kernel.
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_proj_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = norm_cls(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = norm_cls(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.use_rope = cfg.use_rope  # False: no position embedding at all (NoPE, Granite 4.0-H)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | str | None,
        cache: KVCache,
    ) -> torch.Tensor:
        batch, seq, _ = x.shape  # x: [B, S, E]
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_proj_size, self.kv_size, self.kv_size], dim=-1)
        gate = None
        if self.output_gate:
            q, gate = q.view(batch, seq, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(batch, seq, self.q_size)
        q = q.reshape(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)  # q: [B, H, S, D]
        k = k.view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)  # k: [B, Hkv, S, D]
        v = v.view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)  # v: [B, Hkv, S, D]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.use_rope:
            q, k = self.rotate(q, cos, sin), self.rotate(k, cos, sin)
        # a cache that attends itself (the engine's: over its own storage, on its kernels; engine/runner.py attend)
        attend = getattr(cache, "attend", None)
        out = attend(self.layer, q, k, v, mask, self.scale) if attend is not None else None
        if out is None:
            k, v = cache.update(self.layer, k, v)  # k, v: [B, Hkv, L, D]
            causal = isinstance(mask, str)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=None if causal else mask, is_causal=causal, scale=self.scale,
                enable_gqa=self.num_kv_heads != self.num_heads,
            )  # out: [B, H, S, D]
        out = out.transpose(1, 2).reshape(batch, seq, self.q_size)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """apply_rope to q or k [B, H, S, D] (a method: quant/f32.py's KernelAttention runs it on a kernel)."""
        return apply_rope(x, cos, sin)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), with gate and up fused into one matmul."""

    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        self.intermediate = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.intermediate, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(self.intermediate, cfg.hidden_size, bias=cfg.mlp_bias)
        if cfg.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden activation '{cfg.hidden_act}' not supported: {sorted(ACTIVATIONS)}")
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(self.act(gate) * up)


class RotaryTables(nn.Module):
    """Builds the rotary cos/sin tables of every layer type. A module (with no weights) so that its ops
    have a place a target can name: an accelerator's compiler may build these tables on the host."""

    def __init__(self, cfg: ModelConfig, inv_freq: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.cfg = cfg
        self.inv_freq = inv_freq  # shared with the model; fp32, outside the buffers (see CausalLM)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        tables = {}
        for t, inv_freq in self.inv_freq.items():
            rope = self.cfg.rope[t]
            if rope.kind == "dynamic":
                inv_freq = dynamic_ntk_inv_freq(rope, self.cfg.rope_head_dim, positions)
            tables[t] = rope_cos_sin(inv_freq.to(positions.device), positions, dtype, rope.cos_sin_scale)
        return tables


class CausalLM(nn.Module):
    """The skeleton every family shares: embed → layers → norm → lm_head.

    A family supplies its decoder layer class and norm class, and may override `embed`; all take
    token ids + positions + a KV cache (see kv_cache.py).
    """

    def __init__(self, cfg: ModelConfig, layer_cls: type[nn.Module], norm_cls: type[nn.Module]) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layer_cls(cfg, i) for i in range(cfg.num_layers))
        self.norm = norm_cls(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # Kept in fp32 outside the module's buffers, so casting the model to bf16 leaves them exact.
        # (a model without attention layers still gets the full-attention entry its recurrent layers alias)
        attn_types = sorted(set(cfg.layer_types) & {"full_attention", "sliding_attention"}) or ["full_attention"]
        self.inv_freq = {t: rope_inv_freq(cfg.rope[t], cfg.rope_head_dim) for t in attn_types}
        self.rotary = RotaryTables(cfg, self.inv_freq)

    @staticmethod
    def kv_from_reference(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's entries of transformers' KV cache → what `cache.update` receives from ours (the
        same K and V, [B, Hkv, L, D]; a family that caches another layout converts, see deepseek_v3.py)."""
        return keys, values

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [B, S, E]."""
        return self.embed_tokens(input_ids)

    def forward_hidden(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | None = None,
        num_layers: int | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [B, S] → final-normed hidden states [B, S, E].

        num_layers runs only the first layers (an early-exit self-speculative draft).
        """
        cache = NoCache() if cache is None else cache
        x = self.embed(input_ids)  # x: [B, S, E]
        key_positions = cache.begin(positions)  # [B, L] (or per layer type)
        rope = self.rope_tables(positions, x.dtype)
        masks = self.masks(positions, key_positions, allow_shortcuts=True)
        for layer in self.layers[:num_layers]:
            x = layer(x, rope, masks, cache)
        cache.end()
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Logits [B, S, V] for input_ids [B, S]; positions default to 0..S-1 (no cache)."""
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        return self.compute_logits(self.forward_hidden(input_ids, positions, cache))

    def rope_tables(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """cos/sin per layer type, computed once per forward and shared by the layers."""
        return self._alias_state_layers(self.rotary(positions, dtype))

    def _alias_state_layers(self, per_type: dict) -> dict:
        """Recurrent layer types (linear attention) use no rope and no mask; they get the full-attention
        entry so that code indexing by layer type (verify's units) works for every layer."""
        for t in set(self.config.layer_types) - set(per_type):
            per_type[t] = per_type["full_attention"]
        return per_type

    def masks(
        self, positions: torch.Tensor, key_positions: torch.Tensor | dict[str, torch.Tensor],
        allow_shortcuts: bool = False,
    ) -> dict[str, torch.Tensor | str | None]:
        """Attention mask per layer type (full or sliding), built once per forward; always boolean
        tensors unless allow_shortcuts (see attention_mask). key_positions may differ per layer type
        (a dict): a paged cache gathers only the window's keys for sliding layers."""
        cfg = self.config
        window = {t: cfg.sliding_window if t == "sliding_attention" else None for t in self.inv_freq}
        def keys(t: str) -> torch.Tensor:
            return key_positions[t] if isinstance(key_positions, dict) else key_positions
        masks = {t: attention_mask(positions, keys(t), window[t], allow_shortcuts) for t in self.inv_freq}
        return self._alias_state_layers(masks)


class MTPCausalLM(CausalLM):
    """A CausalLM whose checkpoint may ship native multi-token-prediction (MTP) layers (DeepSeek-V3
    report, arXiv:2412.19437 sec. 2.2): `self.mtp` is None without them, else the family's module with

        forward(hidden, embeds, rope, masks, cache, step) -> its normed output [B, S, E]
        step_modules(step) -> the modules one MTP step reads (besides the shared LM head)

    The MTP layers cache K/V as layers num_layers, num_layers + 1, ... (after the target's own)."""

    mtp: nn.Module | None

    def forward_mtp(
        self,
        hidden: torch.Tensor,
        next_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | None = None,
        step: int = 0,
    ) -> torch.Tensor:
        """hidden: the final (normed) hidden states [B, S, E] at `positions` [B, S]; next_ids [B, S]:
        the token after each → the MTP layer's normed output [B, S, E] (feed `compute_logits`, the
        target's LM head, which the MTP layers share). `step` picks the layer (step mod their count)."""
        if self.mtp is None:
            raise ValueError(f"this checkpoint has no MTP layer (config field '{self.config.mtp_field}' is 0)")
        cache = NoCache() if cache is None else cache
        key_positions = cache.begin(positions)
        rope = self.rope_tables(positions, hidden.dtype)
        masks = self.masks(positions, key_positions, allow_shortcuts=True)
        out = self.mtp(hidden, self.embed(next_ids), rope, masks, cache, step)
        cache.end()
        return out
