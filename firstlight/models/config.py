"""ModelConfig: the one typed description every model family is built from.

Read from an HF `config.json` dict by `ModelConfig.from_hf`, which accepts both the classic layout
(`rope_theta`, `rope_scaling`, `rope_local_base_freq`, `sliding_window_pattern`) and the
transformers-5 layout (`rope_parameters`, `layer_types`). Derived fields (head_dim, layer types, rope
per layer type) are filled in once, here, so the model code never re-derives them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from firstlight.errors import ModelLoadError, UnknownModelError

FULL = "full_attention"
SLIDING = "sliding_attention"
LINEAR = "linear_attention"  # Gated DeltaNet (Qwen3-Next, Qwen3.5): a fixed-size recurrent state, no KV
MAMBA = "mamba"  # Mamba-2 SSM mixer (Granite 4.0-H, Nemotron-H): a fixed-size recurrent state, no KV
MLP = "mlp"  # Nemotron-H: a block that is only an MLP (no token mixer, no cache)
MOE = "moe"  # Nemotron-H: a block that is only a mixture of experts (no token mixer, no cache)
ATTENTION_TYPES = (FULL, SLIDING)
STATE_TYPES = (LINEAR, MAMBA)  # layer types that keep a per-request recurrent state instead of KV
FFN_TYPES = (MLP, MOE)  # layer types that keep neither K/V nor a state

# model_type -> "module:Class" of its family (firstlight/models/<module>.py)
FAMILIES: dict[str, str] = {
    "llama": "dense:DenseDecoder",
    "mistral": "dense:DenseDecoder",
    "qwen2": "dense:DenseDecoder",
    "qwen3": "dense:DenseDecoder",
    "gemma3_text": "gemma3:Gemma3",
    "mixtral": "moe:MoEDecoder",
    "qwen2_moe": "moe:MoEDecoder",
    "qwen3_moe": "moe:MoEDecoder",
    "qwen3_next": "qwen3_next:Qwen3Next",
    "qwen3_5_moe": "qwen3_5_moe:Qwen3_5Moe",
    "granitemoehybrid": "granitemoehybrid:GraniteMoeHybrid",
    "nemotron_h": "nemotron_h:NemotronH",
    "deepseek_v3": "deepseek_v3:DeepseekV3",
}
# Multimodal wrappers whose `text_config` we run (the text model alone): wrapper model_type -> ours
TEXT_TOWERS = {"gemma3": "gemma3_text", "qwen3_5_moe": "qwen3_5_moe"}
# model_types a text-only checkpoint of a family is saved under -> ours
ALIASES = {"qwen3_5_moe_text": "qwen3_5_moe"}
# Families with Gated DeltaNet layers: the layer types each allows
HYBRID_LAYER_TYPES = {"qwen3_next": (FULL, SLIDING, LINEAR), "qwen3_5_moe": (FULL, LINEAR)}
# The config field counting a family's native MTP layers
MTP_FIELDS = {"qwen3_next": "num_nextn_predict_layers", "qwen3_5_moe": "mtp_num_hidden_layers",
              "deepseek_v3": "num_nextn_predict_layers"}
ROPE_KINDS = ("default", "llama3", "linear", "yarn", "dynamic")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding frequencies for one layer type (RoFormer, Su et al. 2021)."""

    theta: float
    # default | llama3 (Llama 3.1 frequency-dependent scaling) | linear | yarn (Peng et al. 2023)
    # | dynamic (NTK-aware base growth past the trained length, per forward)
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    partial_rotary_factor: float = 1.0  # rotate only this fraction of each head (Qwen3-Next: 0.25)
    # YaRN: the ramp between interpolated and extrapolated frequencies, and the cos/sin scale
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None  # None: derived from factor (and mscale / mscale_all_dim)
    mscale: float | None = None
    mscale_all_dim: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in ROPE_KINDS:
            raise ModelLoadError(
                f"rope_type '{self.kind}' is not supported; supported: {', '.join(ROPE_KINDS)}"
            )
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise ModelLoadError(f"partial_rotary_factor must lie in (0, 1], got {self.partial_rotary_factor}")

    def rotary_dim(self, head_dim: int) -> int:
        return int(head_dim * self.partial_rotary_factor)

    @property
    def cos_sin_scale(self) -> float:
        """The factor YaRN multiplies cos and sin by (1 for every other kind)."""
        if self.kind != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor

        def get_mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return get_mscale(self.factor, self.mscale) / get_mscale(self.factor, self.mscale_all_dim)
        return get_mscale(self.factor)


@dataclass(frozen=True)
class MoEConfig:
    """Sparse mixture-of-experts MLPs (Shazeer et al. 2017; Mixtral, Qwen-MoE)."""

    num_experts: int
    num_experts_per_tok: int
    intermediate_size: int  # per routed expert
    norm_topk_prob: bool  # renormalize the top-k router probabilities to sum to 1
    sparse_layers: tuple[bool, ...]  # per layer: MoE block (True) or a dense MLP
    shared_expert_intermediate_size: int = 0  # 0: none; else one always-on expert behind a sigmoid gate
    fp32_routing_weights: bool = False  # Mixtral keeps the top-k weights in fp32; Qwen casts to the model dtype
    experts_field: str = "num_experts"  # the config.json field, for error messages
    gated_experts: bool = True  # False: each expert is down(act(up(x))) (Nemotron-H, relu2)
    # DeepSeek-V3 routing (Nemotron-H): sigmoid scores, top-k picked with a per-expert bias among the
    # top `topk_groups` of `num_groups` expert groups, weights scaled by routed_scaling_factor
    sigmoid_routing: bool = False
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    latent_size: int | None = None  # experts work in this width, between two projections (Nemotron-H)

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ModelLoadError(f"config field '{self.experts_field}' must be >= 1, got {self.num_experts}")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ModelLoadError(
                f"config field 'num_experts_per_tok' ({self.num_experts_per_tok}) must lie in "
                f"[1, {self.experts_field}={self.num_experts}]; fix config.json"
            )
        if self.num_groups < 1 or self.num_experts % self.num_groups or not 1 <= self.topk_groups <= self.num_groups:
            raise ModelLoadError(
                f"config fields 'n_group' ({self.num_groups}) and 'topk_group' ({self.topk_groups}): n_group must "
                f"divide {self.experts_field}={self.num_experts} and topk_group lie in [1, n_group]; fix config.json"
            )
        per_group = self.num_experts // self.num_groups
        if self.num_groups > 1 and (per_group < 2 or self.num_experts_per_tok > self.topk_groups * per_group):
            # a group is scored by its two best experts, and the top-k is drawn from the kept groups only
            raise ModelLoadError(
                f"config fields 'n_group' ({self.num_groups}), 'topk_group' ({self.topk_groups}) and "
                f"'num_experts_per_tok' ({self.num_experts_per_tok}): each of the n_group groups of "
                f"{self.experts_field}={self.num_experts} needs >= 2 experts, and the topk_group kept groups >= "
                f"num_experts_per_tok experts; fix config.json"
            )


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head Latent Attention (DeepSeek-AI 2024, "DeepSeek-V2", arXiv:2405.04434, sec. 2.1): keys and
    values are decompressed per head from one shared latent (kv_lora_rank wide, normed) per token; a
    separate rope key (qk_rope_head_dim wide) is shared by all heads. Queries optionally go through a
    low-rank bottleneck too (q_lora_rank; None: one q_proj)."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    rope_interleave: bool = True  # the rope dims of q_proj / kv_a_proj come as interleaved pairs (x0, x1), ...

    def __post_init__(self) -> None:
        if self.qk_rope_head_dim % 2:
            raise ModelLoadError(f"config field 'qk_rope_head_dim' ({self.qk_rope_head_dim}) must be even")
        if self.cache_width % 2:
            raise ModelLoadError(
                f"config field 'kv_lora_rank' ({self.kv_lora_rank}) must be even: the cached latent row "
                f"(kv_lora_rank + qk_rope_head_dim) is split in two halves (deepseek_v3.py)"
            )

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_width(self) -> int:
        """The per-token row the KV cache keeps: the normed latent and the rotated rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class LinearAttnConfig:
    """Gated DeltaNet token mixer (Yang et al. 2024, "Gated Delta Networks"), as in Qwen3-Next."""

    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int  # causal depthwise conv over q/k/v, its state keeps conv_kernel - 1 columns
    # in-projection layout: Qwen3-Next's in_proj_qkvz / in_proj_ba, rows grouped per key head (True), or
    # Qwen3.5's separate in_proj_qkv / in_proj_z / in_proj_b / in_proj_a, each [all heads of q | k | ...]
    grouped_in_proj: bool = True

    def __post_init__(self) -> None:
        if self.num_v_heads % self.num_k_heads:
            raise ModelLoadError(
                f"config field 'linear_num_value_heads' ({self.num_v_heads}) must be a multiple of "
                f"'linear_num_key_heads' ({self.num_k_heads})"
            )

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.k_head_dim + self.num_v_heads * self.v_head_dim


@dataclass(frozen=True)
class Mamba2Config:
    """Mamba-2 token mixer (Dao & Gu 2024, "Transformers are SSMs", arXiv:2405.21060), as in Granite 4.0-H
    and Nemotron-H."""

    num_heads: int
    head_dim: int
    num_groups: int  # B and C are shared by num_heads / num_groups heads (as GQA shares K/V)
    state_size: int  # N: the SSM state per head is [head_dim, N]
    conv_kernel: int  # causal depthwise conv over x|B|C, its state keeps conv_kernel - 1 columns
    chunk_size: int  # HF's scan chunk; ours picks its own (the result does not depend on it)
    conv_bias: bool = True
    proj_bias: bool = False
    time_step_min: float = 0.0  # dt is clamped to [min, max] after softplus
    time_step_max: float = math.inf
    activation: str = "silu"  # after the conv

    def __post_init__(self) -> None:
        if self.num_heads % self.num_groups:
            raise ModelLoadError(
                f"config field 'mamba_n_heads' ({self.num_heads}) must be a multiple of "
                f"'mamba_n_groups' ({self.num_groups})"
            )

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.intermediate_size + 2 * self.num_groups * self.state_size


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int  # heads and width of the KV cache's K and V (MLA: 1, half the latent row; see `mla`)
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    hidden_act: str
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    layer_types: tuple[str, ...]
    rope: dict[str, RopeConfig]  # per layer type
    sliding_window: int | None = None
    attn_scale: float | None = None  # None: head_dim ** -0.5
    final_logit_softcapping: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    moe: MoEConfig | None = None
    linear_attn: LinearAttnConfig | None = None
    attn_output_gate: bool = False  # Qwen3-Next: attention output * sigmoid(gate), gate from q_proj
    num_mtp_layers: int = 0  # native multi-token-prediction layers shipped with the checkpoint
    mamba: Mamba2Config | None = None
    use_rope: bool = True  # False: attention layers take no position embedding (Granite 4.0-H, NoPE)
    # Granite's scalings (muP): embeddings x, each residual branch x, logits / (1.0 elsewhere)
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    mla: MLAConfig | None = None  # DeepSeek-V3's attention
    hf: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)  # the source dict

    @property
    def family(self) -> str:
        return FAMILIES[self.model_type]

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """Layers that keep K/V (attention); the rest keep a recurrent state."""
        return tuple(i for i, t in enumerate(self.layer_types) if t in ATTENTION_TYPES)

    @property
    def state_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t in STATE_TYPES)

    @property
    def rope_head_dim(self) -> int:
        """The head width rope tables are built for (MLA: the rope part of q and k only)."""
        return self.mla.qk_rope_head_dim if self.mla is not None else self.head_dim

    @property
    def mtp_field(self) -> str:
        """The config.json field that counts the MTP layers (for messages)."""
        return MTP_FIELDS.get(self.model_type, "num_nextn_predict_layers")

    def window(self, layer: int) -> int | None:
        """Sliding-window size of a layer, or None for full attention."""
        return self.sliding_window if self.layer_types[layer] == SLIDING else None

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], source: str = "config.json") -> ModelConfig:
        if not isinstance(cfg, dict):
            raise ModelLoadError(f"{source}: expected a JSON object, got a {type(cfg).__name__}")
        model_type = cfg.get("model_type")
        if model_type in TEXT_TOWERS and isinstance(cfg.get("text_config"), dict):  # multimodal wrapper
            cfg = _text_config(cfg)
            model_type = cfg["model_type"]
        model_type = ALIASES.get(model_type, model_type)
        if model_type not in FAMILIES:
            raise UnknownModelError(
                f"{source}: model_type '{model_type}' is not supported; supported: {', '.join(sorted(FAMILIES))}"
            )
        try:
            parsed = _parse(model_type, cfg)
            check_sizes(parsed)
            return parsed
        except KeyError as e:
            raise ModelLoadError(f"{source}: missing required field {e} for model_type '{model_type}'") from e
        except (TypeError, ValueError, ArithmeticError) as e:
            raise ModelLoadError(f"{source}: invalid value ({e})") from e


def _text_config(wrapper: dict[str, Any]) -> dict[str, Any]:
    """A multimodal wrapper's text model config, as its own family, keeping the token ids set at the top
    level (load_config puts generation_config.json's eos there)."""
    outer = {k: wrapper[k] for k in ("eos_token_id", "bos_token_id") if wrapper.get(k) is not None}
    return {**wrapper["text_config"], **outer, "model_type": TEXT_TOWERS[wrapper["model_type"]]}


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


# Largest sizes accepted: far above any released model (vocab 262k, hidden 16k, 128 layers, 10M context,
# 512 experts), far below what would make building the model allocate terabytes before any shape check runs.
MAX_SIZES: dict[str, int] = {"vocab_size": 1 << 22, "hidden_size": 1 << 16, "intermediate_size": 1 << 19,
                             "num_layers": 1 << 10, "num_heads": 1 << 10, "num_kv_heads": 1 << 10,
                             "head_dim": 1 << 12, "max_position_embeddings": 1 << 27}
MOE_MAX_SIZES: dict[str, int] = {"num_experts": 1 << 12, "intermediate_size": 1 << 19}
MAMBA_MAX_SIZES: dict[str, int] = {"num_heads": 1 << 12, "head_dim": 1 << 12, "num_groups": 1 << 10,
                                   "state_size": 1 << 12, "conv_kernel": 1 << 6, "chunk_size": 1 << 16}
LINEAR_ATTN_MAX_SIZES: dict[str, int] = {"num_k_heads": 1 << 10, "num_v_heads": 1 << 10, "k_head_dim": 1 << 12,
                                         "v_head_dim": 1 << 12, "conv_kernel": 1 << 6}
MLA_MAX_SIZES: dict[str, int] = {"kv_lora_rank": 1 << 14, "qk_nope_head_dim": 1 << 12, "qk_rope_head_dim": 1 << 12,
                                 "v_head_dim": 1 << 12}
HF_NAMES = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
            "num_kv_heads": "num_key_value_heads", "moe.intermediate_size": "moe_intermediate_size",
            "linear_attn.num_k_heads": "linear_num_key_heads", "linear_attn.num_v_heads": "linear_num_value_heads",
            "linear_attn.k_head_dim": "linear_key_head_dim", "linear_attn.v_head_dim": "linear_value_head_dim",
            "linear_attn.conv_kernel": "linear_conv_kernel_dim", "mamba.num_heads": "mamba_n_heads",
            "mamba.head_dim": "mamba_d_head", "mamba.num_groups": "mamba_n_groups",
            "mamba.state_size": "mamba_d_state", "mamba.conv_kernel": "mamba_d_conv",
            "mamba.chunk_size": "mamba_chunk_size"}
# Nemotron-H spells the Mamba-2 sizes as transformers' NemotronHConfig does
NEMOTRON_HF_NAMES = {**HF_NAMES, "mamba.num_heads": "mamba_num_heads", "mamba.head_dim": "mamba_head_dim",
                     "mamba.num_groups": "n_groups", "mamba.state_size": "ssm_state_size",
                     "mamba.conv_kernel": "conv_kernel", "mamba.chunk_size": "chunk_size"}


def _int(cfg: dict[str, Any], key: str, default: int | None = None) -> int:
    """An integer field, named in the error when it is not one (`"vocab_size": "many"`, 1.5, true)."""
    value = cfg[key] if default is None else cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value):
        raise ValueError(f"{key} = {value!r} is not an integer")
    return int(value)


def _positive(cfg: dict[str, Any], key: str, default: int | None = None) -> int:
    """An integer field that must be >= 1 (a period, a stride or a count something is divided by)."""
    value = _int(cfg, key, default)
    if value < 1:
        raise ValueError(f"{key} = {value} must be >= 1")
    return value


def _check(obj: Any, limits: dict[str, int], prefix: str = "", experts_field: str | None = None,
           names: dict[str, str] = HF_NAMES) -> None:
    for name, limit in limits.items():
        value = getattr(obj, name)
        key = names.get(prefix + name, name)
        if name == "num_experts" and experts_field:
            key = experts_field
        if not 1 <= value <= limit:
            raise ValueError(f"{key} = {value} is not a plausible size (expected 1 to {limit})")


def check_sizes(cfg: ModelConfig) -> None:
    """Every size is a positive integer no larger than its limit (named by its config.json key), the
    MoE, linear-attention (hybrid) and MLA sizes included."""
    if cfg.mla is not None:  # first: the cache's head_dim is derived from them
        _check(cfg.mla, MLA_MAX_SIZES if cfg.mla.q_lora_rank is None else {**MLA_MAX_SIZES, "q_lora_rank": 1 << 16})
    _check(cfg, MAX_SIZES)
    if cfg.sliding_window is not None and not 1 <= cfg.sliding_window <= MAX_SIZES["max_position_embeddings"]:
        raise ValueError(f"sliding_window = {cfg.sliding_window} is not a plausible size "
                         f"(expected 1 to {MAX_SIZES['max_position_embeddings']})")
    if not 0 <= cfg.num_mtp_layers <= MAX_SIZES["num_layers"]:
        raise ValueError(f"{cfg.mtp_field} = {cfg.num_mtp_layers} is not a plausible count "
                         f"(expected 0 to {MAX_SIZES['num_layers']})")
    if cfg.moe is not None:
        _check(cfg.moe, MOE_MAX_SIZES, "moe.", cfg.moe.experts_field)
        shared = cfg.moe.shared_expert_intermediate_size
        if not 0 <= shared <= MOE_MAX_SIZES["intermediate_size"]:
            raise ValueError(f"shared_expert_intermediate_size = {shared} is not a plausible size "
                             f"(expected 0 to {MOE_MAX_SIZES['intermediate_size']})")
    if cfg.linear_attn is not None:
        _check(cfg.linear_attn, LINEAR_ATTN_MAX_SIZES, "linear_attn.")
    if cfg.mamba is not None:
        _check(cfg.mamba, MAMBA_MAX_SIZES, "mamba.", names=NEMOTRON_HF_NAMES if cfg.model_type == "nemotron_h" else HF_NAMES)


def _rope(params: dict[str, Any] | None, theta: float, cfg: dict[str, Any]) -> RopeConfig:
    params = dict(params or {})
    kind = params.get("rope_type", params.get("type", "default"))
    max_pos = _int(cfg, "max_position_embeddings", 4096)
    # dynamic NTK grows the base past the trained length, which is max_position_embeddings itself
    default_orig = max_pos if kind == "dynamic" else 8192
    factor = params.get("factor")
    if factor is None and kind == "yarn" and "original_max_position_embeddings" in params:
        factor = max_pos / float(params["original_max_position_embeddings"])  # DeepSeek-style yarn
    return RopeConfig(
        theta=float(params.get("rope_theta", theta)),
        kind=kind,
        factor=float(1.0 if factor is None else factor),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", default_orig)),
        partial_rotary_factor=float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        attention_factor=_opt_float(params.get("attention_factor")),
        mscale=_opt_float(params.get("mscale")),
        mscale_all_dim=_opt_float(params.get("mscale_all_dim")),
    )


# Granite 4.0-H names its layers mamba / attention; transformers 5 writes them back as linear_attention /
# full_attention (`configuration_utils._LEGACY_LAYER_TYPE_REMAP`). Either spelling is read.
GRANITE_LAYER_TYPES = {"mamba": MAMBA, "linear_attention": MAMBA, "attention": FULL, "full_attention": FULL}


def _granite_layer_types(cfg: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    key = "layer_types" if cfg.get("layer_types") else "layers_block_type"
    names = cfg.get(key)
    if not names:  # transformers' default: every layer a Mamba layer
        return (MAMBA,) * num_layers
    if not isinstance(names, list):
        raise ValueError(f"config field '{key}' must be a list of layer types, got {names!r}")
    unknown = sorted({str(t) for t in names if t not in GRANITE_LAYER_TYPES})
    if unknown:
        raise ValueError(
            f"config field '{key}' has unknown layer type(s) {unknown} for granitemoehybrid; "
            f"allowed: {sorted(GRANITE_LAYER_TYPES)}"
        )
    if len(names) != num_layers:
        raise ValueError(f"config field '{key}' must list {num_layers} layers, got {len(names)}")
    return tuple(GRANITE_LAYER_TYPES[t] for t in names)


# Nemotron-H: one block per layer, a character of `hybrid_override_pattern` (hub configs) or a word of
# `layers_block_type` (what transformers 5 writes back; `layer_types` is its alias)
NEMOTRON_LAYER_TYPES = {"M": MAMBA, "*": FULL, "-": MLP, "E": MOE, "linear_attention": MAMBA, "mamba": MAMBA,
                        "full_attention": FULL, "attention": FULL, "mlp": MLP, "moe": MOE}


def _nemotron_layer_types(cfg: dict[str, Any]) -> tuple[str, ...]:
    """The block kinds, checked against `num_hidden_layers` when the config has it (transformers 5 drops it)."""
    key = next((k for k in ("hybrid_override_pattern", "layers_block_type", "layer_types") if cfg.get(k)), None)
    if key is None:
        raise ValueError("nemotron_h needs config field 'hybrid_override_pattern' (one of M, *, -, E per layer, "
                         "e.g. \"M-M*-\") or 'layers_block_type'")
    kinds = cfg[key]
    if not isinstance(kinds, str if key == "hybrid_override_pattern" else list):
        raise ValueError(f"config field '{key}' must be a {'string' if key == 'hybrid_override_pattern' else 'list'}, "
                         f"got {kinds!r}")
    unknown = sorted({str(k) for k in kinds if k not in NEMOTRON_LAYER_TYPES})
    if unknown:
        allowed = "M (Mamba-2), * (attention), - (MLP), E (MoE)" if key == "hybrid_override_pattern" else \
            "linear_attention, full_attention, mlp, moe"
        raise ValueError(f"config field '{key}' has unknown layer kind(s) {unknown} for nemotron_h; allowed: {allowed}")
    declared = cfg.get("num_hidden_layers")
    if declared is not None and _int(cfg, "num_hidden_layers") != len(kinds):
        raise ValueError(f"config field '{key}' lists {len(kinds)} layers but num_hidden_layers is {declared}; "
                         "they must agree")
    return tuple(NEMOTRON_LAYER_TYPES[k] for k in kinds)


def _layer_types(model_type: str, cfg: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    if model_type == "granitemoehybrid":
        return _granite_layer_types(cfg, num_layers)
    allowed = HYBRID_LAYER_TYPES.get(model_type, (FULL, SLIDING))
    if cfg.get("layer_types"):
        types = tuple(cfg["layer_types"])
        unknown = sorted({t for t in types if t not in allowed})
        if unknown:
            raise ValueError(
                f"config field 'layer_types' has unknown layer type(s) {unknown} for {model_type}; "
                f"allowed: {list(allowed)}"
            )
        if len(types) != num_layers:
            raise ValueError(f"config field 'layer_types' must list {num_layers} layers, got {len(types)}")
        return types
    window = cfg.get("sliding_window")
    if model_type in HYBRID_LAYER_TYPES:
        interval = _positive(cfg, "full_attention_interval", 4)
        return tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in range(num_layers))
    if model_type == "gemma3_text":
        key = "sliding_window_pattern" if "sliding_window_pattern" in cfg else "_sliding_window_pattern"
        pattern = _positive(cfg, key, 6)
        return tuple(FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers))
    if model_type in ("mistral", "mixtral") and window:
        return (SLIDING,) * num_layers
    if model_type == "qwen3_moe" and cfg.get("use_sliding_window") and window:
        return (SLIDING,) * num_layers
    if model_type == "qwen2_moe" and cfg.get("use_sliding_window") and window:
        first = int(cfg.get("max_window_layers", num_layers))
        return tuple(SLIDING if (i + 1) % 2 and i < first else FULL for i in range(num_layers))
    if model_type in ("qwen2", "qwen3") and cfg.get("use_sliding_window") and window:
        first = int(cfg.get("max_window_layers", num_layers))
        return tuple(SLIDING if i >= first else FULL for i in range(num_layers))
    return (FULL,) * num_layers


def _parse(model_type: str, cfg: dict[str, Any]) -> ModelConfig:
    hybrid = model_type in HYBRID_LAYER_TYPES  # Qwen3-Next, Qwen3.5-MoE
    if hybrid:
        cfg = {"partial_rotary_factor": 0.25, **cfg}  # transformers' default for these families
    hidden = _int(cfg, "hidden_size")
    num_heads = _int(cfg, "num_attention_heads")
    nemotron = model_type == "nemotron_h"
    nemotron_types = _nemotron_layer_types(cfg) if nemotron else ()
    num_layers = len(nemotron_types) if nemotron else _int(cfg, "num_hidden_layers")
    if num_heads < 1 or num_layers < 1:
        raise ValueError(f"num_attention_heads = {num_heads} and num_hidden_layers = {num_layers} must be >= 1")
    num_kv_heads = int(cfg.get("num_key_value_heads") or num_heads)
    head_dim = int(cfg.get("head_dim") or hidden // num_heads)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}")
    layer_types = nemotron_types or _layer_types(model_type, cfg, num_layers)
    gemma = model_type == "gemma3_text"
    granite = model_type == "granitemoehybrid"
    mla = _mla(cfg) if model_type == "deepseek_v3" else None
    if mla is not None:  # the cache holds one latent row per token, half in K and half in V (deepseek_v3.py)
        num_kv_heads, head_dim = 1, mla.cache_width // 2

    # Rope: transformers 5 nests parameters per layer type; classic configs keep them flat.
    rp = cfg.get("rope_parameters")
    theta = float(cfg.get("rope_theta", 10000.0))
    if rp and (FULL in rp or SLIDING in rp):
        rope = {t: _rope(rp.get(t), theta, cfg) for t in (FULL, SLIDING) if t in rp}
    else:
        full = _rope(rp if rp else cfg.get("rope_scaling"), theta, cfg)
        rope = {FULL: full}
        if gemma:
            rope[SLIDING] = RopeConfig(theta=float(cfg.get("rope_local_base_freq", 10000.0)))
        else:
            rope[SLIDING] = full
    if SLIDING not in rope:
        rope[SLIDING] = rope[FULL]
    if FULL not in rope:
        rope[FULL] = rope[SLIDING]

    if cfg.get("attn_logit_softcapping"):
        raise ValueError("attn_logit_softcapping is not supported (Gemma 2 style); Gemma 3 does not use it")
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    attention_bias = bool(cfg.get("attention_bias", False))
    qwen2_like = model_type in ("qwen2", "qwen2_moe")
    max_pos = _int(cfg, "max_position_embeddings", 4096)
    attn_scale = (float(cfg["query_pre_attn_scalar"]) ** -0.5 if gemma
                  else float(cfg.get("attention_multiplier", 1.0)) if granite
                  else _mla_scale(mla, rope[FULL]) if mla is not None else None)
    if rope[FULL].kind == "dynamic":  # the context dynamic NTK scaling is made for
        max_pos = int(max_pos * rope[FULL].factor)
    return ModelConfig(
        model_type=model_type,
        vocab_size=_int(cfg, "vocab_size"),
        hidden_size=hidden,
        # Granite: the always-on shared MLP is the dense MLP; `intermediate_size` sizes its experts
        # Qwen3.5-MoE has no dense MLP (every layer is sparse): the always-on shared expert stands in
        intermediate_size=(_int(cfg, "shared_intermediate_size", 1024) if granite
                           else _int(cfg, "shared_expert_intermediate_size") if model_type == "qwen3_5_moe"
                           else _int(cfg, "intermediate_size")),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        rms_norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5) if nemotron else cfg.get("rms_norm_eps", 1e-6)),
        hidden_act=str(cfg.get("mlp_hidden_act", "relu2") if nemotron
                       else cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"),
        # Nemotron-H never ties its head (transformers' NemotronHForCausalLM has no tied weights)
        tie_word_embeddings=False if nemotron else bool(cfg.get("tie_word_embeddings", gemma)),
        # Qwen2(-MoE) has q/k/v biases (always / per qkv_bias) and never an o bias; Nemotron-H's attention
        # has none whatever attention_bias says; the others follow attention_bias.
        qkv_bias=bool(cfg.get("qkv_bias", True)) if qwen2_like else attention_bias and not nemotron,
        o_bias=False if qwen2_like else attention_bias and not nemotron,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=hybrid or model_type in ("qwen3", "gemma3_text", "qwen3_moe"),
        layer_types=layer_types,
        rope=rope,
        sliding_window=_int(cfg, "sliding_window") if SLIDING in layer_types else None,
        attn_scale=attn_scale,
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        moe=_nemotron_moe(cfg, layer_types) if nemotron else _moe(model_type, cfg, num_layers),
        linear_attn=_linear_attn(cfg, grouped_in_proj=model_type == "qwen3_next") if LINEAR in layer_types else None,
        attn_output_gate=hybrid,
        num_mtp_layers=_int(cfg, MTP_FIELDS[model_type], 0) if model_type in MTP_FIELDS else 0,
        mamba=(_nemotron_mamba(cfg) if nemotron else _mamba(cfg, hidden)) if MAMBA in layer_types else None,
        # Granite 4.0-H per position_embedding_type; Nemotron-H's attention never takes rope
        use_rope=cfg.get("position_embedding_type") == "rope" if granite else not nemotron,
        embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)) if granite else 1.0,
        residual_multiplier=float(cfg.get("residual_multiplier", 1.0)) if granite else 1.0,
        logits_scaling=float(cfg.get("logits_scaling", 1.0)) if granite else 1.0,
        mla=mla,
        hf=dict(cfg),
    )


def _moe(model_type: str, cfg: dict[str, Any], num_layers: int) -> MoEConfig | None:
    """Which layers are sparse and how they route, as each family's HF decoder layer decides it."""
    if model_type == "mixtral":
        return MoEConfig(
            num_experts=_int(cfg, "num_local_experts", 8),
            num_experts_per_tok=_int(cfg, "num_experts_per_tok", 2),
            intermediate_size=_int(cfg, "intermediate_size"),
            norm_topk_prob=True,  # Mixtral always renormalizes the top-k
            sparse_layers=(True,) * num_layers,
            fp32_routing_weights=True,
            experts_field="num_local_experts",
        )
    if model_type == "granitemoehybrid":  # top-k over all experts in every layer, or none (dense)
        num_experts = _int(cfg, "num_local_experts", 8)
        if num_experts == 0:
            return None
        return MoEConfig(
            num_experts=num_experts,
            num_experts_per_tok=_int(cfg, "num_experts_per_tok", 2),
            intermediate_size=_int(cfg, "intermediate_size"),
            norm_topk_prob=True,  # softmax over the top-k logits == renormalized top-k probabilities
            sparse_layers=(True,) * num_layers,
            experts_field="num_local_experts",
        )
    if model_type == "qwen3_5_moe":  # every layer sparse, top-k always renormalized, a gated shared expert
        return MoEConfig(
            num_experts=_int(cfg, "num_experts"),
            num_experts_per_tok=_int(cfg, "num_experts_per_tok"),
            intermediate_size=_int(cfg, "moe_intermediate_size"),
            norm_topk_prob=True,
            sparse_layers=(True,) * num_layers,
            shared_expert_intermediate_size=_int(cfg, "shared_expert_intermediate_size"),
        )
    if model_type == "deepseek_v3":
        return _deepseek_moe(cfg, num_layers)
    if model_type not in ("qwen2_moe", "qwen3_moe", "qwen3_next"):
        return None
    # hub checkpoints say num_experts; transformers 5 writes some families back as num_local_experts
    field_name = "num_experts" if "num_experts" in cfg or "num_local_experts" not in cfg else "num_local_experts"
    num_experts = _int(cfg, field_name)
    step = _positive(cfg, "decoder_sparse_step", 1)
    dense_only = set(cfg.get("mlp_only_layers") or ())
    sparse = tuple(i not in dense_only and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers))
    return MoEConfig(
        num_experts=num_experts,
        num_experts_per_tok=_int(cfg, "num_experts_per_tok"),
        intermediate_size=_int(cfg, "moe_intermediate_size"),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", model_type == "qwen3_next")),
        sparse_layers=sparse,
        shared_expert_intermediate_size=(
            0 if model_type == "qwen3_moe" else _int(cfg, "shared_expert_intermediate_size")
        ),
        experts_field=field_name,
    )


def _mla(cfg: dict[str, Any]) -> MLAConfig:
    """DeepSeek-V3's attention sizes (transformers' DeepseekV3Config names; its default q_lora_rank)."""
    q_rank = cfg.get("q_lora_rank", 1536)
    return MLAConfig(
        kv_lora_rank=_positive(cfg, "kv_lora_rank"),
        qk_nope_head_dim=_positive(cfg, "qk_nope_head_dim"),
        qk_rope_head_dim=_positive(cfg, "qk_rope_head_dim"),
        v_head_dim=_positive(cfg, "v_head_dim"),
        q_lora_rank=None if q_rank is None else _positive(cfg, "q_lora_rank"),
        rope_interleave=bool(cfg.get("rope_interleave", True)),
    )


def _mla_scale(mla: MLAConfig, rope: RopeConfig) -> float:
    """The softmax scale: 1/sqrt(qk_head_dim), times YaRN's mscale squared when the rope is scaled with
    `mscale_all_dim` (DeepSeek-V2's yarn_get_mscale; transformers' `yarn_apply_mscale`)."""
    scale = mla.qk_head_dim**-0.5
    if rope.kind != "default" and rope.mscale_all_dim and rope.factor > 1:
        mscale = 0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0
        scale *= mscale * mscale
    return scale


def _deepseek_moe(cfg: dict[str, Any], num_layers: int) -> MoEConfig:
    """DeepSeek-V3's MLPs: dense in the first `first_k_dense_replace` layers, then routed experts (sigmoid
    scores over expert groups, moe.py's SigmoidGroupRouter) plus always-on shared experts. Defaults are
    transformers' DeepseekV3Config's."""
    first_dense = _int(cfg, "first_k_dense_replace", 3)
    if first_dense < 0:
        raise ValueError(f"first_k_dense_replace = {first_dense} must be >= 0")
    return MoEConfig(
        num_experts=_int(cfg, "n_routed_experts", 256),
        num_experts_per_tok=_int(cfg, "num_experts_per_tok", 8),
        intermediate_size=_int(cfg, "moe_intermediate_size", 2048),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        sparse_layers=tuple(i >= first_dense for i in range(num_layers)),
        shared_expert_intermediate_size=_int(cfg, "moe_intermediate_size", 2048) * _int(cfg, "n_shared_experts", 1),
        fp32_routing_weights=True,
        experts_field="n_routed_experts",
        sigmoid_routing=True,
        num_groups=_int(cfg, "n_group", 8),
        topk_groups=_int(cfg, "topk_group", 4),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 2.5)),
    )


def _linear_attn(cfg: dict[str, Any], grouped_in_proj: bool) -> LinearAttnConfig:
    return LinearAttnConfig(
        num_k_heads=_positive(cfg, "linear_num_key_heads"),
        num_v_heads=_int(cfg, "linear_num_value_heads"),
        k_head_dim=_int(cfg, "linear_key_head_dim"),
        v_head_dim=_int(cfg, "linear_value_head_dim"),
        conv_kernel=_int(cfg, "linear_conv_kernel_dim", 4),
        grouped_in_proj=grouped_in_proj,
    )


def _limit(value: Any, key: str) -> float:
    """A time-step bound: a number, or transformers' JSON spelling of infinity ({"__float__": "Infinity"})."""
    if isinstance(value, dict) and set(value) == {"__float__"}:
        value = value["__float__"]
    try:
        if isinstance(value, bool):
            raise TypeError
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"time_step_limit {key} = {value!r} is not a number (e.g. [0.0, \"Infinity\"])") from None


def _dt_limit(cfg: dict[str, Any]) -> tuple[float, float]:
    """The [min, max] that dt is clamped to after its softplus: `time_step_limit` (or the legacy `mamba_dt_limit`),
    default none."""
    limit = cfg.get("time_step_limit", cfg.get("mamba_dt_limit")) or (0.0, math.inf)
    if not isinstance(limit, list | tuple) or len(limit) != 2:
        raise ValueError(f"time_step_limit = {limit!r} must be a [min, max] pair")
    return _limit(limit[0], "min"), _limit(limit[1], "max")


def _mamba(cfg: dict[str, Any], hidden: int) -> Mamba2Config:
    num_heads = _positive(cfg, "mamba_n_heads", 128)
    expand = _positive(cfg, "mamba_expand", 2)
    head_dim = cfg.get("mamba_d_head", "auto")
    head_dim = expand * hidden // num_heads if head_dim == "auto" else _int(cfg, "mamba_d_head")
    if num_heads * head_dim != expand * hidden:
        raise ValueError(f"mamba_n_heads ({num_heads}) x mamba_d_head ({head_dim}) must equal "
                         f"mamba_expand ({expand}) x hidden_size ({hidden})")
    dt_min, dt_max = _dt_limit(cfg)
    return Mamba2Config(
        num_heads=num_heads,
        head_dim=head_dim,
        num_groups=_positive(cfg, "mamba_n_groups", 1),
        state_size=_int(cfg, "mamba_d_state", 256),
        conv_kernel=_int(cfg, "mamba_d_conv", 4),
        chunk_size=_int(cfg, "mamba_chunk_size", 256),
        conv_bias=bool(cfg.get("mamba_conv_bias", True)),
        proj_bias=bool(cfg.get("mamba_proj_bias", False)),
        time_step_min=dt_min,
        time_step_max=dt_max,
        activation=str(cfg.get("hidden_act") or "silu"),
    )


def _nemotron_mamba(cfg: dict[str, Any]) -> Mamba2Config:
    """Nemotron-H's Mamba-2 sizes (transformers' NemotronHConfig names and defaults, the legacy mamba_*
    spellings it also reads). Width is mamba_num_heads x mamba_head_dim (`expand` is not used). dt is clamped to
    time_step_limit, as transformers' mixer does from 5.25 on (as Mamba-2's dt_limit; `time_step_min` only sets the
    dt bias's initial range). transformers up to 5.24 clamped at time_step_min instead, in prefill only."""
    def get(key: str, legacy: str, default: int) -> int:
        return _int(cfg, key if key in cfg else legacy, default)

    num_heads = _positive(cfg, "mamba_num_heads", 128)
    groups = get("n_groups", "mamba_n_groups", 8)
    dt_min, dt_max = _dt_limit(cfg)
    if groups < 1 or num_heads % groups:
        raise ValueError(f"config field 'mamba_num_heads' ({num_heads}) must be a multiple of 'n_groups' ({groups})")
    return Mamba2Config(
        num_heads=num_heads,
        head_dim=_int(cfg, "mamba_head_dim", 64),
        num_groups=groups,
        state_size=_int(cfg, "ssm_state_size", 128),
        conv_kernel=get("conv_kernel", "mamba_d_conv", 4),
        chunk_size=get("chunk_size", "mamba_chunk_size", 128),
        conv_bias=bool(cfg.get("use_conv_bias", cfg.get("mamba_conv_bias", True))),
        proj_bias=bool(cfg.get("use_bias", False)),
        time_step_min=dt_min,
        time_step_max=dt_max,
        activation=str(cfg.get("mamba_hidden_act", "silu")),
    )


def _nemotron_moe(cfg: dict[str, Any], layer_types: tuple[str, ...]) -> MoEConfig | None:
    """The `E` blocks: DeepSeek-V3 routing over ungated experts, plus one always-on shared MLP."""
    if MOE not in layer_types:
        return None
    return MoEConfig(
        num_experts=_int(cfg, "n_routed_experts", 8),
        num_experts_per_tok=_int(cfg, "num_experts_per_tok", 2),
        intermediate_size=_int(cfg, "moe_intermediate_size", 7688),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        sparse_layers=tuple(t == MOE for t in layer_types),
        shared_expert_intermediate_size=_int(cfg, "moe_shared_expert_intermediate_size", 7688),
        fp32_routing_weights=True,
        experts_field="n_routed_experts",
        gated_experts=False,
        sigmoid_routing=True,
        num_groups=_int(cfg, "n_group", 1),
        topk_groups=_int(cfg, "topk_group", 1),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        latent_size=None if cfg.get("moe_latent_size") is None else _positive(cfg, "moe_latent_size"),
    )
