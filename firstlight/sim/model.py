"""Model descriptions for the cost model, derived from a Hugging Face `config.json` dict.

A `ModelDesc` is the shape of the network and nothing else: layer groups (layers that share one
attention and MLP shape), the linear layers in each, attention geometry (GQA, sliding window, MLA)
and MoE routing. From it follow parameter counts, KV bytes per token and, in `cost.py`, FLOPs and
bytes per op for any Batch.

Conventions (cite: Kaplan et al. 2020 appendix / the usual 2*N FLOPs per token per weight):
a linear of `in x out` costs 2*in*out FLOPs per token and reads in*out weights once per step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from firstlight.core.hardware import DTYPE_BYTES
from firstlight.errors import FirstlightError
from firstlight.sim.precision import PrecisionProfile, uniform


class ModelConfigError(FirstlightError):
    """A config.json the simulator cannot describe."""


@dataclass(frozen=True)
class Linear:
    name: str
    in_features: int
    out_features: int

    @property
    def num_params(self) -> int:
        return self.in_features * self.out_features


@dataclass(frozen=True)
class AttentionDesc:
    num_heads: int
    num_kv_heads: int
    head_dim: int  # q/k head dim used in QK^T (for MLA: the absorbed dim kv_lora_rank + rope dim)
    v_head_dim: int  # dim of the values each head mixes (for MLA absorbed: kv_lora_rank)
    kv_elems_per_token: int  # elements stored in the KV cache per token per layer
    sliding_window: int | None = None
    is_mla: bool = False

    @property
    def flops_per_pair(self) -> int:
        """FLOPs for one (query, key) pair over all heads: QK^T plus PV (FlashAttention-2 paper, sec. 3)."""
        return 2 * self.num_heads * (self.head_dim + self.v_head_dim)


@dataclass(frozen=True)
class MoEDesc:
    num_experts: int
    top_k: int
    expert_linears: tuple[Linear, ...]  # one expert's linears
    shared_linears: tuple[Linear, ...] = ()  # always-active shared experts, fused

    @property
    def expert_params(self) -> int:
        return sum(lin.num_params for lin in self.expert_linears)


@dataclass(frozen=True)
class LinearAttnDesc:
    """A linear-attention (Gated DeltaNet) token mixer: a fixed-size state per sequence, no KV cache."""

    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.k_head_dim + self.num_v_heads * self.v_head_dim

    @property
    def state_elems(self) -> int:
        """Elements of one sequence's state: the delta-rule matrix per value head + the conv inputs."""
        return self.num_v_heads * self.k_head_dim * self.v_head_dim + self.conv_dim * (self.conv_kernel - 1)

    @property
    def scan_flops_per_token(self) -> int:
        """The recurrence per token and value head on S [Dk, Dv] (Yang et al. 2024, eq. 5): decay (1),
        S^T k (2), rank-1 write (2) and the read S^T q (2) = 7 Dk Dv; the chunked prefill form does the
        same work plus O(chunk) intra-chunk terms, ignored here."""
        return 7 * self.num_v_heads * self.k_head_dim * self.v_head_dim


@dataclass(frozen=True)
class Mamba2Desc:
    """A Mamba-2 token mixer (Dao & Gu 2024, arXiv:2405.21060; Granite 4.0-H): per sequence a conv state
    [conv_dim, K-1] and an SSM state [H, P, N], no KV cache. in_proj yields z (I), x|B|C (conv_dim) and
    dt (H), with I = H*P and conv_dim = I + 2*G*N (B and C shared by the H/G heads of a group)."""

    num_heads: int  # H
    head_dim: int  # P
    num_groups: int  # G
    state_size: int  # N
    conv_kernel: int  # K
    chunk_size: int = 256  # Q: the SSD chunk of the prefill scan

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.intermediate_size + 2 * self.num_groups * self.state_size

    @property
    def conv_state_elems(self) -> int:
        return self.conv_dim * (self.conv_kernel - 1)

    @property
    def ssm_state_elems(self) -> int:
        return self.num_heads * self.head_dim * self.state_size

    @property
    def decode_flops_per_token(self) -> int:
        """The recurrence per token and head on S [P, N]: decay (1), the write dt x B^T (2) and the read
        S C (2) = 5 P N (paper sec. 3, the linear/recurrent mode)."""
        return 5 * self.ssm_state_elems

    def prefill_flops(self, num_tokens: int) -> float:
        """The chunked SSD scan (paper sec. 6) over one prefill chunk of `num_tokens` tokens, in chunks of
        q = min(num_tokens, Q): per chunk C B^T per group (2 q^2 N G), the masked scores times x per head
        (2 q^2 P H), the chunk's final state (2 q P N H) and the read of the entering state (2 q P N H),
        plus one state hand-off per chunk (P N H). Per token: 2 q (G N + H P) + 4 H P N."""
        if num_tokens <= 0:
            return 0.0
        q = min(num_tokens, self.chunk_size)
        g, n, h, p = self.num_groups, self.state_size, self.num_heads, self.head_dim
        chunks = -(-num_tokens // q)
        return num_tokens * (2.0 * q * (g * n + h * p) + 4.0 * h * p * n) + chunks * h * p * n


@dataclass(frozen=True)
class LayerGroup:
    """`num_layers` identical decoder layers."""

    num_layers: int
    attention: AttentionDesc
    attn_linears: tuple[Linear, ...]
    mlp_linears: tuple[Linear, ...]  # dense MLP, or the router for MoE layers
    moe: MoEDesc | None = None
    num_norm_params: int = 0
    linear: LinearAttnDesc | None = None  # a linear-attention group (attention then keeps no KV)
    mamba: Mamba2Desc | None = None  # a Mamba-2 group (no KV either)

    @property
    def mixer(self) -> str:
        if self.mamba:
            return "mamba2"
        if self.linear:
            return "linear_attention"
        return "attention" if self.attn_linears else "none"  # Nemotron-H's MLP-only layers


@dataclass(frozen=True)
class ModelDesc:
    name: str
    hidden_size: int
    vocab_size: int
    groups: tuple[LayerGroup, ...]
    tie_word_embeddings: bool = False
    weight_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    act_dtype: str = "bf16"
    max_position_embeddings: int | None = None
    meta: dict[str, Any] = field(default_factory=dict, compare=False)
    precision: PrecisionProfile | None = None  # per tensor group dtypes; None = uniform(weight, kv, act)

    @property
    def profile(self) -> PrecisionProfile:
        """The precision profile in force: the explicit one, or the one the single dtypes imply."""
        return self.precision or uniform(self.weight_dtype, self.kv_dtype, self.act_dtype)

    # ---- counts -------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return sum(g.num_layers for g in self.groups)

    @property
    def attention_group(self) -> LayerGroup:
        """The first group whose layers keep KV (the first group when no layer does)."""
        return next((g for g in self.groups if g.attention.kv_elems_per_token), self.groups[0])

    @property
    def num_heads(self) -> int:
        return self.attention_group.attention.num_heads

    @property
    def num_kv_heads(self) -> int:
        return self.attention_group.attention.num_kv_heads

    @property
    def is_moe(self) -> bool:
        return any(g.moe is not None for g in self.groups)

    @property
    def num_experts(self) -> int:
        return max((g.moe.num_experts for g in self.groups if g.moe), default=0)

    def embedding_params(self) -> int:
        n = self.vocab_size * self.hidden_size
        return n if self.tie_word_embeddings else 2 * n

    def layer_params(self, group: LayerGroup, active_only: bool = False) -> int:
        n = sum(lin.num_params for lin in group.attn_linears + group.mlp_linears) + group.num_norm_params
        if group.moe is not None:
            n_experts = group.moe.top_k if active_only else group.moe.num_experts
            n += n_experts * group.moe.expert_params + sum(lin.num_params for lin in group.moe.shared_linears)
        return n

    def expert_params(self) -> int:
        """Parameters in routed experts (what expert parallelism splits)."""
        return sum(g.num_layers * g.moe.num_experts * g.moe.expert_params for g in self.groups if g.moe)

    def num_params(self) -> int:
        layers = sum(g.num_layers * self.layer_params(g) for g in self.groups)
        return layers + self.embedding_params() + self.hidden_size  # + final norm

    def num_active_params(self) -> int:
        """Parameters touched per token (routed experts counted top_k times)."""
        layers = sum(g.num_layers * self.layer_params(g, active_only=True) for g in self.groups)
        return layers + self.embedding_params() + self.hidden_size

    def params_by_group(self) -> dict[str, int]:
        """Parameters per tensor group: attention, mlp (dense, shared experts, router), experts (routed),
        embedding (input + untied LM head, final and per-layer norms). Sums to num_params()."""
        out = {"attention": 0, "mlp": 0, "experts": 0, "embedding": self.embedding_params() + self.hidden_size}
        for g in self.groups:
            out["attention"] += g.num_layers * sum(lin.num_params for lin in g.attn_linears)
            mlp = sum(lin.num_params for lin in g.mlp_linears)
            if g.moe is not None:
                mlp += sum(lin.num_params for lin in g.moe.shared_linears)
                out["experts"] += g.num_layers * g.moe.num_experts * g.moe.expert_params
            out["mlp"] += g.num_layers * mlp
            out["embedding"] += g.num_layers * g.num_norm_params
        return out

    def weight_bytes_by_group(self) -> dict[str, float]:
        """Bytes per tensor group at the profile's dtypes (embedding and norms at the LM head's dtype)."""
        p = self.profile
        dt = {"attention": p.weights("attention"), "mlp": p.weights("mlp"), "experts": p.weights("experts"),
              "embedding": p.weights("lm_head")}
        return {g: n * DTYPE_BYTES[dt[g]] for g, n in self.params_by_group().items()}

    def weight_bytes(self) -> float:
        return sum(self.weight_bytes_by_group().values())

    def kv_bytes_per_token(self) -> float:
        """KV cache bytes one token adds across all layers (sliding-window layers included, uncapped)."""
        elems = sum(g.num_layers * g.attention.kv_elems_per_token for g in self.groups)
        return elems * DTYPE_BYTES[self.profile.kv_cache]

    def kv_bytes_for_context(self, context_len: int) -> float:
        """KV bytes one sequence of `context_len` tokens holds (sliding-window layers keep only the window)."""
        total = 0.0
        for g in self.groups:
            w = g.attention.sliding_window
            n = min(context_len, w) if w else context_len
            total += g.num_layers * g.attention.kv_elems_per_token * n
        return total * DTYPE_BYTES[self.profile.kv_cache]

    def state_bytes_per_seq(self) -> float:
        """Recurrent-state bytes one sequence holds whatever its length: linear-attention layers in fp32
        (as the engine keeps the delta-rule state); Mamba-2 layers their SSM state [H, P, N] in fp32 and
        their conv state [conv_dim, K-1] at the activation dtype (as the engine and vLLM keep them)."""
        total = 4.0 * sum(g.num_layers * g.linear.state_elems for g in self.groups if g.linear)
        ab = DTYPE_BYTES[self.profile.activations]
        for g in self.groups:
            if g.mamba:
                total += g.num_layers * (4.0 * g.mamba.ssm_state_elems + ab * g.mamba.conv_state_elems)
        return total

    def flops_per_token(self, context_len: int = 0) -> float:
        """Forward FLOPs of one token at a given context: 2 * active params (minus embedding gather) +
        attention + linear-attention scans."""
        params = self.num_active_params() - self.vocab_size * self.hidden_size  # the input gather is free
        attn = 0
        for g in self.groups:
            if g.linear is not None:
                attn += g.num_layers * g.linear.scan_flops_per_token
                continue
            if g.mamba is not None:  # a decode token: the recurrent form
                attn += g.num_layers * g.mamba.decode_flops_per_token
                continue
            w = g.attention.sliding_window
            span = min(context_len, w) if w else context_len
            attn += g.num_layers * g.attention.flops_per_pair * span
        return 2.0 * params + attn

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "vocab_size": self.vocab_size,
            "num_params": self.num_params(),
            "num_active_params": self.num_active_params(),
            "num_experts": self.num_experts,
            "weight_dtype": self.weight_dtype,
            "precision": self.profile.summary(),
            "weight_bytes": self.weight_bytes(),
            "kv_bytes_per_token": self.kv_bytes_per_token(),
            "state_bytes_per_seq": self.state_bytes_per_seq(),
            "flops_per_token_ctx0": self.flops_per_token(0),
            "groups": [
                {
                    "num_layers": g.num_layers,
                    "mixer": g.mixer,
                    "sliding_window": g.attention.sliding_window,
                    "mla": g.attention.is_mla,
                    "moe": None if g.moe is None else {"num_experts": g.moe.num_experts, "top_k": g.moe.top_k},
                }
                for g in self.groups
            ],
        }


# ---- parsing an HF config ---------------------------------------------------------------------


def _req(cfg: dict[str, Any], key: str, where: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise ModelConfigError(
            f"model config {where} has no {key!r}: expected a decoder-only HF config.json "
            "(Llama/Mistral/Qwen/Mixtral/DeepSeek/Gemma style)"
        )
    return cfg[key]


def _first(cfg: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    return default


def _dtype_name(v: Any) -> str:
    s = str(v or "bfloat16").replace("torch.", "")
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "half": "fp16", "float": "fp32"}.get(s, "bf16")


def _attention(cfg: dict[str, Any], where: str, window: int | None) -> tuple[AttentionDesc, tuple[Linear, ...], int]:
    hidden = int(_req(cfg, "hidden_size", where))
    num_heads = int(_req(cfg, "num_attention_heads", where))
    if cfg.get("kv_lora_rank"):  # MLA (DeepSeek-V2/V3): cache the compressed latent + the rope key
        kv_rank = int(cfg["kv_lora_rank"])
        q_rank = cfg.get("q_lora_rank")
        nope = int(_req(cfg, "qk_nope_head_dim", where))
        rope = int(_req(cfg, "qk_rope_head_dim", where))
        v_dim = int(_req(cfg, "v_head_dim", where))
        qk = nope + rope
        lins: list[Linear] = []
        if q_rank:
            lins += [Linear("q_a_proj", hidden, int(q_rank)), Linear("q_b_proj", int(q_rank), num_heads * qk)]
        else:
            lins.append(Linear("q_proj", hidden, num_heads * qk))
        lins += [
            Linear("kv_a_proj", hidden, kv_rank + rope),
            Linear("kv_b_proj", kv_rank, num_heads * (nope + v_dim)),
            Linear("o_proj", num_heads * v_dim, hidden),
        ]
        norms = kv_rank + (int(q_rank) if q_rank else 0)
        # Decode with weight absorption (DeepSeek-V2 paper sec. 2.1.2): every head attends over the
        # latent, so QK^T runs over kv_rank + rope dims and PV over kv_rank dims; one shared "KV head".
        att = AttentionDesc(num_heads, 1, kv_rank + rope, kv_rank, kv_rank + rope, window, is_mla=True)
        return att, tuple(lins), norms
    num_kv = int(_first(cfg, "num_key_value_heads", default=num_heads))
    head_dim = int(_first(cfg, "head_dim", default=hidden // num_heads))
    if num_heads % num_kv:
        raise ModelConfigError(
            f"model config {where}: num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv}"
        )
    # per-head output gate (Qwen3.5-MoE's text model: qwen3_5_moe_text inside its multimodal wrapper)
    gate = num_heads if cfg.get("model_type") in ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text") else 0
    lins = (
        Linear("qkv_proj", hidden, (num_heads + gate + 2 * num_kv) * head_dim),
        Linear("o_proj", num_heads * head_dim, hidden),
    )
    att = AttentionDesc(num_heads, num_kv, head_dim, head_dim, 2 * num_kv * head_dim, window)
    return att, lins, 0


def _moe_layer_ids(cfg: dict[str, Any], num_layers: int) -> set[int]:
    num_experts = _first(cfg, "num_local_experts", "num_experts", "n_routed_experts", default=0) or 0
    if not num_experts:
        return set()
    first_dense = int(cfg.get("first_k_dense_replace") or 0)
    dense_only = set(cfg.get("mlp_only_layers") or [])
    ids = {i for i in range(first_dense, num_layers) if i not in dense_only}
    if int(cfg.get("moe_layer_freq") or 1) > 1:  # DeepSeek: layer_idx % freq == 0
        ids = {i for i in ids if i % int(cfg["moe_layer_freq"]) == 0}
    if int(cfg.get("decoder_sparse_step") or 1) > 1:  # Qwen-MoE: (layer_idx + 1) % step == 0
        ids = {i for i in ids if (i + 1) % int(cfg["decoder_sparse_step"]) == 0}
    return ids


def _linear_layer_ids(cfg: dict[str, Any], num_layers: int, where: str) -> set[int]:
    """Qwen3-Next-style linear-attention layers: from layer_types, or every layer but each
    full_attention_interval-th when the config has linear-attention fields and no layer_types."""
    types = cfg.get("layer_types")
    if types:
        known = {"full_attention", "sliding_attention", "linear_attention"}
        unknown = sorted(set(types) - known)
        if unknown:
            raise ModelConfigError(f"model config {where}: layer_types has unknown type(s) {unknown}; known: {sorted(known)}")
        return {i for i, t in enumerate(types) if t == "linear_attention"}
    if cfg.get("linear_num_value_heads"):
        interval = int(cfg.get("full_attention_interval") or 4)
        return {i for i in range(num_layers) if (i + 1) % interval}
    return set()


# Granite 4.0-H names its layers mamba / attention; transformers 5 writes them back as linear_attention /
# full_attention. Either spelling is read (as models/config.py reads them).
_GRANITE_TYPES = {"mamba": "mamba", "linear_attention": "mamba", "attention": "attention",
                  "full_attention": "attention"}


def _mamba_layer_ids(cfg: dict[str, Any], num_layers: int, where: str) -> set[int]:
    """Granite 4.0-H's Mamba-2 layers: from layer_types (or layers_block_type); every layer without either."""
    if cfg.get("model_type") != "granitemoehybrid":
        return set()
    key = "layer_types" if cfg.get("layer_types") else "layers_block_type"
    names = cfg.get(key)
    if not names:  # transformers' default: every layer a Mamba layer
        return set(range(num_layers))
    unknown = sorted({str(t) for t in names if t not in _GRANITE_TYPES})
    if unknown:
        raise ModelConfigError(f"model config {where}: {key} has unknown type(s) {unknown} for granitemoehybrid; "
                               f"known: {sorted(_GRANITE_TYPES)}")
    if len(names) != num_layers:
        raise ModelConfigError(f"model config {where}: {key} has {len(names)} entries, expected {num_layers}")
    return {i for i, t in enumerate(names) if _GRANITE_TYPES[t] == "mamba"}


def _mamba2(cfg: dict[str, Any], where: str) -> tuple[AttentionDesc, tuple[Linear, ...], Mamba2Desc, int]:
    """A Mamba-2 mixer: (its no-KV attention stand-in, linears, description, extra small params)."""
    hidden = int(_req(cfg, "hidden_size", where))
    # Granite's names first, then Nemotron-H's
    heads = int(_first(cfg, "mamba_n_heads", "mamba_num_heads", default=128))
    expand = int(_first(cfg, "mamba_expand", "expand", default=2))
    head_dim = _first(cfg, "mamba_d_head", "mamba_head_dim", default="auto")
    head_dim = expand * hidden // heads if head_dim == "auto" else int(head_dim)
    mb = Mamba2Desc(num_heads=heads, head_dim=head_dim, num_groups=int(_first(cfg, "mamba_n_groups", "n_groups", default=1)),
                    state_size=int(_first(cfg, "mamba_d_state", "ssm_state_size", default=256)),
                    conv_kernel=int(_first(cfg, "mamba_d_conv", "conv_kernel", default=4)),
                    chunk_size=int(_first(cfg, "mamba_chunk_size", "chunk_size", default=256)))
    if mb.num_heads % mb.num_groups:
        raise ModelConfigError(f"model config {where}: mamba_n_heads={mb.num_heads} is not a multiple of "
                               f"mamba_n_groups={mb.num_groups}")
    i, conv = mb.intermediate_size, mb.conv_dim
    in_out = i + conv + mb.num_heads  # z | x B C | dt
    lins = (
        Linear("mamba_in_proj", hidden, in_out),
        Linear("mamba_conv1d", mb.conv_kernel, conv),  # depthwise: K weights per channel
        Linear("mamba_out_proj", i, hidden),
    )
    # dt_bias, A_log, D per head; the gated RMSNorm over I; the conv bias; projection biases if any
    extra = 3 * mb.num_heads + i + (conv if _first(cfg, "mamba_conv_bias", "use_conv_bias", default=True) else 0)
    if cfg.get("mamba_proj_bias") or (cfg.get("model_type") == "nemotron_h" and cfg.get("use_bias")):
        extra += in_out + hidden  # Nemotron-H's in/out projections follow use_bias (transformers)
    att = AttentionDesc(mb.num_heads, mb.num_heads, 0, 0, 0, None)  # no KV, no (query, key) pairs
    return att, lins, mb, extra


# Nemotron-H: one block per layer, named by a character of hybrid_override_pattern (or a word of
# layers_block_type): a Mamba-2 mixer, attention, a dense MLP or an MoE, each behind one RMSNorm.
# transformers 5 writes the list back as linear_attention / full_attention / mlp / moe.
_NEMOTRON_KINDS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe", "mamba": "mamba",
                   "attention": "attention", "mlp": "mlp", "moe": "moe", "linear_attention": "mamba",
                   "full_attention": "attention"}


def _nemotron_h_groups(cfg: dict[str, Any], num_layers: int, where: str) -> list[LayerGroup]:
    """Nemotron-H layer groups: mixer-only layers (M, *) keep no MLP, MLP-only layers (-, E) no mixer.
    MLPs and experts are ungated (relu2): up and down projections only."""
    hidden = int(_req(cfg, "hidden_size", where))
    key = "hybrid_override_pattern" if cfg.get("hybrid_override_pattern") else "layers_block_type"
    pattern = cfg.get(key)
    if not pattern:
        raise ModelConfigError(f"model config {where}: nemotron_h needs hybrid_override_pattern (M, *, -, E per layer)")
    kinds = list(pattern)
    unknown = sorted({str(k) for k in kinds if k not in _NEMOTRON_KINDS})
    if unknown:
        raise ModelConfigError(f"model config {where}: {key} has unknown type(s) {unknown}; known: M * - E")
    if len(kinds) != num_layers:
        raise ModelConfigError(f"model config {where}: {key} has {len(kinds)} entries, expected {num_layers}")
    counts: dict[str, int] = {}
    for k in kinds:
        counts[_NEMOTRON_KINDS[k]] = counts.get(_NEMOTRON_KINDS[k], 0) + 1
    heads = int(_req(cfg, "num_attention_heads", where))
    kv = int(_first(cfg, "num_key_value_heads", default=heads))
    no_mixer = AttentionDesc(heads, kv, 0, 0, 0, None)  # an MLP-only layer: no KV, no pairs
    out: list[LayerGroup] = []
    for kind, n in counts.items():
        if kind == "mamba":
            att, lins, mb, extra = _mamba2(cfg, where)
            out.append(LayerGroup(n, att, lins, (), None, hidden + extra, mamba=mb))
        elif kind == "attention":
            att, lins, extra = _attention(cfg, where, None)
            out.append(LayerGroup(n, att, lins, (), None, hidden + extra))
        elif kind == "mlp":
            inter = int(_req(cfg, "intermediate_size", where))
            mlp = (Linear("up_proj", hidden, inter), Linear("down_proj", inter, hidden))
            out.append(LayerGroup(n, no_mixer, (), mlp, None, hidden))
        else:
            num_experts = int(_req(cfg, "n_routed_experts", where))
            top_k = int(_req(cfg, "num_experts_per_tok", where))
            inter = int(_req(cfg, "moe_intermediate_size", where))
            if top_k > num_experts:
                raise ModelConfigError(f"model config {where}: num_experts_per_tok={top_k} > experts={num_experts}")
            expert = (Linear("expert_up", hidden, inter), Linear("expert_down", inter, hidden))
            s = int(cfg.get("n_shared_experts") or 0) * int(cfg.get("moe_shared_expert_intermediate_size") or inter)
            shared = (Linear("shared_up", hidden, s), Linear("shared_down", s, hidden)) if s else ()
            moe = MoEDesc(num_experts, top_k, expert, shared)
            # the router and its per-expert score-correction bias
            out.append(LayerGroup(n, no_mixer, (), (Linear("router", hidden, num_experts),), moe, hidden + num_experts))
    return out


def _linear_attention(cfg: dict[str, Any], where: str) -> tuple[AttentionDesc, tuple[Linear, ...], LinearAttnDesc]:
    hidden = int(_req(cfg, "hidden_size", where))
    la = LinearAttnDesc(
        num_k_heads=int(_req(cfg, "linear_num_key_heads", where)),
        num_v_heads=int(_req(cfg, "linear_num_value_heads", where)),
        k_head_dim=int(_req(cfg, "linear_key_head_dim", where)),
        v_head_dim=int(_req(cfg, "linear_value_head_dim", where)),
        conv_kernel=int(cfg.get("linear_conv_kernel_dim") or 4),
    )
    key_dim, value_dim = la.num_k_heads * la.k_head_dim, la.num_v_heads * la.v_head_dim
    lins = (
        Linear("in_proj_qkvz", hidden, 2 * key_dim + 2 * value_dim),
        Linear("in_proj_ba", hidden, 2 * la.num_v_heads),
        Linear("conv1d", la.conv_kernel, la.conv_dim),  # depthwise: K weights per channel
        Linear("out_proj", value_dim, hidden),
    )
    # no KV and no (query, key) pairs: the cost model prices the scan from `linear` instead
    att = AttentionDesc(la.num_v_heads, la.num_v_heads, 0, 0, 0, None)
    return att, lins, la


def _windows(cfg: dict[str, Any], num_layers: int) -> list[int | None]:
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if types:
        return [int(window) if (t == "sliding_attention" and window) else None for t in types]
    if not window or cfg.get("use_sliding_window") is False:
        return [None] * num_layers
    max_window_layers = cfg.get("max_window_layers")
    if cfg.get("use_sliding_window") and max_window_layers is not None:
        # Qwen2: layers >= max_window_layers use the window
        return [int(window) if i >= int(max_window_layers) else None for i in range(num_layers)]
    return [int(window)] * num_layers


def model_from_config(cfg: dict[str, Any], name: str = "", where: str = "<config>", weight_dtype: str | None = None,
                      kv_dtype: str | None = None, precision: PrecisionProfile | None = None) -> ModelDesc:
    """Describe a decoder-only model from its HF config dict (multimodal configs: the `text_config`)."""
    if not isinstance(cfg, dict):
        raise ModelConfigError(f"model config {where} must be a JSON object")
    if isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg["text_config"], "torch_dtype": cfg.get("torch_dtype", cfg["text_config"].get("torch_dtype"))}
    hidden = int(_req(cfg, "hidden_size", where))
    if cfg.get("model_type") == "nemotron_h" and cfg.get("num_hidden_layers") is None and cfg.get("layers_block_type"):
        cfg = {**cfg, "num_hidden_layers": len(cfg["layers_block_type"])}  # transformers 5 drops it
    num_layers = int(_req(cfg, "num_hidden_layers", where))
    vocab = int(_req(cfg, "vocab_size", where))
    for key in ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads"):
        if int(cfg.get(key) or 0) <= 0:
            raise ModelConfigError(f"model config {where}: {key} must be a positive integer, got {cfg.get(key)!r}")
    if cfg.get("model_type") == "nemotron_h":
        return _describe(cfg, _nemotron_h_groups(cfg, num_layers, where), hidden, vocab, name, where, weight_dtype,
                         kv_dtype, precision)
    moe_ids = _moe_layer_ids(cfg, num_layers)
    windows = _windows(cfg, num_layers)
    if len(windows) != num_layers:
        raise ModelConfigError(f"model config {where}: layer_types has {len(windows)} entries, expected {num_layers}")

    granite = cfg.get("model_type") == "granitemoehybrid"
    mamba_ids = _mamba_layer_ids(cfg, num_layers, where)
    linear_ids = set() if granite else _linear_layer_ids(cfg, num_layers, where)
    groups: dict[tuple[int | None, bool, str], int] = {}
    for i in range(num_layers):
        key = (windows[i], i in moe_ids, "mamba2" if i in mamba_ids else "linear" if i in linear_ids else "attention")
        groups[key] = groups.get(key, 0) + 1

    built: list[LayerGroup] = []
    for (window, is_moe, mixer), count in groups.items():
        linear = mamba = None
        if mixer == "linear":
            att, attn_lins, linear = _linear_attention(cfg, where)
            extra_norms = linear.v_head_dim
        elif mixer == "mamba2":
            att, attn_lins, mamba, extra_norms = _mamba2(cfg, where)
        else:
            att, attn_lins, extra_norms = _attention(cfg, where, window)
        norms = 2 * hidden + extra_norms
        moe = None
        if is_moe:
            num_experts = int(_first(cfg, "num_local_experts", "num_experts", "n_routed_experts"))
            top_k = int(_req(cfg, "num_experts_per_tok", where))
            inter = int(_first(cfg, "moe_intermediate_size", "intermediate_size"))
            expert = (Linear("expert_gate_up", hidden, 2 * inter), Linear("expert_down", inter, hidden))
            shared: tuple[Linear, ...] = ()
            if cfg.get("n_shared_experts"):
                s = int(cfg["n_shared_experts"]) * inter
                shared = (Linear("shared_gate_up", hidden, 2 * s), Linear("shared_down", s, hidden))
            elif granite and cfg.get("shared_intermediate_size"):  # Granite: an always-on, ungated shared MLP
                s = int(cfg["shared_intermediate_size"])
                shared = (Linear("shared_gate_up", hidden, 2 * s), Linear("shared_down", s, hidden))
            elif cfg.get("shared_expert_intermediate_size"):
                s = int(cfg["shared_expert_intermediate_size"])
                shared = (Linear("shared_gate_up", hidden, 2 * s), Linear("shared_down", s, hidden),
                          Linear("shared_expert_gate", hidden, 1))
            if top_k > num_experts:
                raise ModelConfigError(f"model config {where}: num_experts_per_tok={top_k} > experts={num_experts}")
            moe = MoEDesc(num_experts, top_k, expert, shared)
            mlp: tuple[Linear, ...] = (Linear("router", hidden, num_experts),)
        else:  # Granite without experts: the shared MLP is the dense MLP
            inter = int(_first(cfg, "shared_intermediate_size", "intermediate_size") if granite else _req(cfg, "intermediate_size", where))
            mlp = (Linear("gate_up_proj", hidden, 2 * inter), Linear("down_proj", inter, hidden))
        built.append(LayerGroup(count, att, attn_lins, mlp, moe, norms, linear, mamba))
    return _describe(cfg, built, hidden, vocab, name, where, weight_dtype, kv_dtype, precision)


def _describe(cfg: dict[str, Any], built: list[LayerGroup], hidden: int, vocab: int, name: str, where: str,
              weight_dtype: str | None, kv_dtype: str | None, precision: PrecisionProfile | None) -> ModelDesc:
    wdt = weight_dtype or _dtype_name(_first(cfg, "torch_dtype", "dtype"))
    if precision is not None:  # weight/kv dtypes given with a profile override its storage groups
        precision = precision.with_dtypes(weight_dtype, kv_dtype)
        wdt, kv_dtype = precision.attention_weights, precision.kv_cache
    return ModelDesc(
        name=name or str(_first(cfg, "_name_or_path", "model_type", default="model")),
        hidden_size=hidden,
        vocab_size=vocab,
        groups=tuple(built),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        weight_dtype=wdt,
        kv_dtype=kv_dtype or (wdt if wdt in ("bf16", "fp16") else "bf16"),
        max_position_embeddings=cfg.get("max_position_embeddings"),
        meta={"architectures": cfg.get("architectures"), "model_type": cfg.get("model_type")},
        act_dtype=precision.activations if precision is not None else "bf16",
        precision=precision,
    )


def load_model(path_or_name: str | Path, weight_dtype: str | None = None, kv_dtype: str | None = None,
               precision: PrecisionProfile | str | None = None) -> ModelDesc:
    """A model from a config.json path, a checkpoint directory holding one, or a preset name.

    `precision`: a profile (or its builtin name / YAML path) giving each tensor group its dtype."""
    if isinstance(precision, (str, Path)):
        from firstlight.sim.precision import load_precision

        precision = load_precision(precision)
    from firstlight.sim.presets import PRESETS

    s = str(path_or_name)
    if s in PRESETS:
        return model_from_config(PRESETS[s], name=s, where=f"preset {s}", weight_dtype=weight_dtype, kv_dtype=kv_dtype,
                                 precision=precision)
    p = Path(s)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ModelConfigError(
            f"model {s!r}: no such config.json or directory; expected a path or one of the presets {sorted(PRESETS)}"
        )
    try:
        cfg = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ModelConfigError(f"model config {p} is not valid JSON: {e}") from None
    return model_from_config(cfg, name=p.parent.name or p.stem, where=str(p), weight_dtype=weight_dtype, kv_dtype=kv_dtype,
                             precision=precision)
