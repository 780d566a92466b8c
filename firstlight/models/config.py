"""ModelConfig: the one typed description every model family is built from.

Read from an HF `config.json` dict by `ModelConfig.from_hf`, which accepts both the classic layout
(`rope_theta`, `rope_scaling`, `rope_local_base_freq`, `sliding_window_pattern`) and the
transformers-5 layout (`rope_parameters`, `layer_types`). Derived fields (head_dim, layer types, rope
per layer type) are filled in once, here, so the model code never re-derives them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from firstlight.errors import ModelLoadError, UnknownModelError

FULL = "full_attention"
SLIDING = "sliding_attention"

# model_type -> "module:Class" of its family (firstlight/models/<module>.py)
FAMILIES: dict[str, str] = {
    "llama": "dense:DenseDecoder",
    "mistral": "dense:DenseDecoder",
    "qwen2": "dense:DenseDecoder",
    "qwen3": "dense:DenseDecoder",
    "gemma3_text": "gemma3:Gemma3",
}
ROPE_KINDS = ("default", "llama3", "linear")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding frequencies for one layer type (RoFormer, Su et al. 2021)."""

    theta: float
    kind: str = "default"  # default | llama3 (Llama 3.1 frequency-dependent scaling) | linear
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.kind not in ROPE_KINDS:
            raise ModelLoadError(
                f"rope_type '{self.kind}' is not supported; supported: {', '.join(ROPE_KINDS)}"
            )


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
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
    hf: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)  # the source dict

    @property
    def family(self) -> str:
        return FAMILIES[self.model_type]

    def window(self, layer: int) -> int | None:
        """Sliding-window size of a layer, or None for full attention."""
        return self.sliding_window if self.layer_types[layer] == SLIDING else None

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], source: str = "config.json") -> ModelConfig:
        if not isinstance(cfg, dict):
            raise ModelLoadError(f"{source}: expected a JSON object, got a {type(cfg).__name__}")
        model_type = cfg.get("model_type")
        if model_type == "gemma3" and "text_config" in cfg:  # multimodal wrapper: use its text tower
            cfg = {**cfg["text_config"], "model_type": "gemma3_text"}
            model_type = "gemma3_text"
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


# Largest sizes accepted: far above any released model (vocab 262k, hidden 16k, 128 layers, 10M context),
# far below what would make building the model allocate terabytes before any shape check runs.
MAX_SIZES: dict[str, int] = {"vocab_size": 1 << 22, "hidden_size": 1 << 16, "intermediate_size": 1 << 19,
                             "num_layers": 1 << 10, "num_heads": 1 << 10, "num_kv_heads": 1 << 10,
                             "head_dim": 1 << 12, "max_position_embeddings": 1 << 27}
HF_NAMES = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
            "num_kv_heads": "num_key_value_heads"}


def _int(cfg: dict[str, Any], key: str, default: int | None = None) -> int:
    """An integer field, named in the error when it is not one (`"vocab_size": "many"`, 1.5, true)."""
    value = cfg[key] if default is None else cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value):
        raise ValueError(f"{key} = {value!r} is not an integer")
    return int(value)


def check_sizes(cfg: ModelConfig) -> None:
    """Every size is a positive integer no larger than MAX_SIZES (named by its config.json key)."""
    for name, limit in MAX_SIZES.items():
        value = getattr(cfg, name)
        if not 1 <= value <= limit:
            raise ValueError(f"{HF_NAMES.get(name, name)} = {value} is not a plausible size (expected 1 to {limit})")


def _rope(params: dict[str, Any] | None, theta: float) -> RopeConfig:
    params = dict(params or {})
    kind = params.get("rope_type", params.get("type", "default"))
    return RopeConfig(
        theta=float(params.get("rope_theta", theta)),
        kind=kind,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


def _layer_types(model_type: str, cfg: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    if cfg.get("layer_types"):
        types = tuple(cfg["layer_types"])
        if len(types) != num_layers or any(t not in (FULL, SLIDING) for t in types):
            raise ValueError(f"layer_types must list {num_layers} of '{FULL}'/'{SLIDING}', got {types}")
        return types
    window = cfg.get("sliding_window")
    if model_type == "gemma3_text":
        pattern = int(cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6)))
        return tuple(FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers))
    if model_type == "mistral" and window:
        return (SLIDING,) * num_layers
    if model_type in ("qwen2", "qwen3") and cfg.get("use_sliding_window") and window:
        first = int(cfg.get("max_window_layers", num_layers))
        return tuple(SLIDING if i >= first else FULL for i in range(num_layers))
    return (FULL,) * num_layers


def _parse(model_type: str, cfg: dict[str, Any]) -> ModelConfig:
    hidden = _int(cfg, "hidden_size")
    num_heads = _int(cfg, "num_attention_heads")
    num_layers = _int(cfg, "num_hidden_layers")
    if num_heads < 1 or num_layers < 1:
        raise ValueError(f"num_attention_heads = {num_heads} and num_hidden_layers = {num_layers} must be >= 1")
    num_kv_heads = int(cfg.get("num_key_value_heads") or num_heads)
    head_dim = int(cfg.get("head_dim") or hidden // num_heads)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}")
    layer_types = _layer_types(model_type, cfg, num_layers)
    gemma = model_type == "gemma3_text"

    # Rope: transformers 5 nests parameters per layer type; classic configs keep them flat.
    rp = cfg.get("rope_parameters")
    theta = float(cfg.get("rope_theta", 10000.0))
    if rp and (FULL in rp or SLIDING in rp):
        rope = {t: _rope(rp.get(t), theta) for t in (FULL, SLIDING) if t in rp}
    else:
        full = _rope(rp if rp else cfg.get("rope_scaling"), theta)
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
    return ModelConfig(
        model_type=model_type,
        vocab_size=_int(cfg, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_int(cfg, "intermediate_size"),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=_int(cfg, "max_position_embeddings", 4096),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        hidden_act=str(cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
        # Qwen2 always has q/k/v biases and never an o bias; the others follow attention_bias.
        qkv_bias=True if model_type == "qwen2" else attention_bias,
        o_bias=False if model_type == "qwen2" else attention_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=model_type in ("qwen3", "gemma3_text"),
        layer_types=layer_types,
        rope=rope,
        sliding_window=int(cfg["sliding_window"]) if SLIDING in layer_types else None,
        attn_scale=float(cfg["query_pre_attn_scalar"]) ** -0.5 if gemma else None,
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        hf=dict(cfg),
    )
