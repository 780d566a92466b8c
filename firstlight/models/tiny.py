"""Tiny random-weight checkpoints of every supported family, written as real HF checkpoint dirs.

The weights come from the HF reference classes (so the dir is valid for transformers by
construction), re-drawn with fan-in scaling so logits have real margins, with random norm weights
and biases so that a missing scale or bias shows up in parity tests. The tokenizer is a byte-level
BPE trained on a fixed text, with a ChatML chat template.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from firstlight.errors import UnknownModelError
from firstlight.models.config import FAMILIES, FULL, MTP_FIELDS, SLIDING

_BASE: dict[str, Any] = {
    "vocab_size": 384,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
# What makes each tiny family exercise its distinguishing features.
TINY: dict[str, dict[str, Any]] = {
    "llama": {
        "tie_word_embeddings": False,
        "attention_bias": True,
        "mlp_bias": True,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 32},
    },
    "mistral": {"tie_word_embeddings": False, "sliding_window": 8},
    "qwen2": {"tie_word_embeddings": True},
    "qwen3": {"tie_word_embeddings": True},
    "gemma3_text": {
        "tie_word_embeddings": True,
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": 8,
        "layer_types": [SLIDING, SLIDING, FULL, SLIDING],
        "query_pre_attn_scalar": 24,
        "rope_parameters": {
            FULL: {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 2.0},
            SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
        },
    },
    # sparse MoE: few experts, top-2; a dense layer among the sparse ones where the family allows
    "mixtral": {"tie_word_embeddings": False, "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {
        "tie_word_embeddings": False, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48, "norm_topk_prob": False, "mlp_only_layers": [2],
    },
    "qwen3_moe": {
        "tie_word_embeddings": False, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "norm_topk_prob": True, "decoder_sparse_step": 2,
    },
    # hybrid: 3 Gated DeltaNet layers per gated full-attention layer, MoE with a shared expert (one
    # dense layer), partial rope, grouped value heads, and one MTP layer (added by `_add_mtp_weights`)
    "qwen3_next": {
        "tie_word_embeddings": False, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48, "norm_topk_prob": True, "mlp_only_layers": [1],
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4, "num_nextn_predict_layers": 1,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    },
    # Qwen3-Next's pattern with Qwen3.5's flat Gated DeltaNet projections, every layer sparse, interleaved
    # mrope (sections of the 4 rotary frequencies), one MTP layer; written as the hub's vision-language wrapper
    "qwen3_5_moe": {
        "tie_word_embeddings": False, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4, "mtp_num_hidden_layers": 1,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                            "mrope_section": [2, 1, 1], "mrope_interleaved": True},
    },
    # hybrid: Mamba-2 layers around one attention layer (NoPE, as Granite 4.0-H), 2 SSM groups, routed
    # experts + a shared MLP, Granite's muP multipliers away from 1, a scan chunk shorter than the prompts
    "granitemoehybrid": {
        "tie_word_embeddings": False, "intermediate_size": 32, "shared_intermediate_size": 48,
        "num_local_experts": 4, "num_experts_per_tok": 2,
        "layer_types": ["mamba", "mamba", "attention", "mamba"], "position_embedding_type": "nope",
        "mamba_n_heads": 8, "mamba_n_groups": 2, "mamba_d_state": 16, "mamba_d_head": 16, "mamba_d_conv": 4,
        "mamba_expand": 2, "mamba_chunk_size": 8,
        "embedding_multiplier": 2.0, "residual_multiplier": 0.5, "attention_multiplier": 0.2,
        "logits_scaling": 2.0,
    },
    # hybrid: one module per layer in a Nemotron-H-like pattern (Mamba-2, relu2 MLP, NoPE attention, MoE),
    # 2 SSM groups, Mamba projection biases, DeepSeek-V3 routing over 2 expert groups with a scaling
    # factor and a random correction bias (drawn in `_randomize`), a scan chunk shorter than the prompts.
    # dt biases as trained (`_draw_dt_bias`) with time_step_min ~0: transformers up to 5.24 clamped dt at
    # time_step_min in prefill but not in decode, so a clamp that bites made its own generate disagree with its
    # forward (test_nemotron_h.py checks the time_step_limit clamp on its own)
    "nemotron_h": {
        "tie_word_embeddings": False, "num_hidden_layers": 7, "hybrid_override_pattern": "M-M*-EM",
        "mamba_num_heads": 8, "mamba_head_dim": 16, "n_groups": 2, "ssm_state_size": 16, "conv_kernel": 4,
        "chunk_size": 8, "use_bias": True, "layer_norm_epsilon": 1e-5, "time_step_min": 1e-9,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "moe_shared_expert_intermediate_size": 48, "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5,
    },
    # MLA with a q bottleneck and interleaved rope dims, v_head_dim unlike qk_nope_head_dim; YaRN with an
    # mscale and mscale_all_dim that both bite (cos/sin scale and softmax scale), over a 32-token original
    # context (max_position_embeddings = factor x it, as DeepSeek-V3's); one dense layer, then DeepSeek-V3 routing over 4 groups of 2 experts (top 2 groups, top 3
    # experts, a random correction bias) with two shared experts' worth of shared MLP; one MTP layer (added by
    # `_add_mtp_weights` as the hub lays it out, `model.layers.4.*`)
    "deepseek_v3": {
        "tie_word_embeddings": False, "num_key_value_heads": 4, "head_dim": 8,
        "q_lora_rank": 32, "kv_lora_rank": 24, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12,
        "rope_interleave": True, "first_k_dense_replace": 1, "n_routed_experts": 8, "n_group": 4,
        "topk_group": 2, "num_experts_per_tok": 3, "moe_intermediate_size": 32, "n_shared_experts": 2,
        "routed_scaling_factor": 2.5, "norm_topk_prob": True, "num_nextn_predict_layers": 1,
        "max_position_embeddings": 128,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                            "original_max_position_embeddings": 32, "beta_fast": 32.0, "beta_slow": 1.0,
                            "mscale": 0.8, "mscale_all_dim": 0.6},
    },
}
ALIASES = {"gemma3": "gemma3_text"}
# Families the hub ships as vision-language wrappers: the text model's own model_type, and a one-block
# vision tower for the wrapper (its weights sit in the files beside the text model's, as on the hub)
TEXT_MODEL_TYPES = {"qwen3_5_moe": "qwen3_5_moe_text"}
VISION: dict[str, dict[str, Any]] = {
    "qwen3_5_moe": {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 4,
                    "num_position_embeddings": 16},
}
SPECIAL = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = (
    "The quick brown fox jumps over the lazy dog. The capital of France is Paris. "
    "Shall I compare thee to a summer's day? Thou art more lovely and more temperate. "
    "def main():\n    return sum(range(10))\n"
    "To be, or not to be, that is the question. Numbers 0 1 2 3 4 5 6 7 8 9 and more. "
)


def tiny_config(family: str, **overrides: Any) -> dict[str, Any]:
    """The HF config dict of a tiny model of `family` (a model_type), with overrides applied."""
    family = ALIASES.get(family, family)
    if family not in TINY:
        raise UnknownModelError(f"unknown family '{family}' for a tiny model; supported: {', '.join(sorted(TINY))}")
    return {"model_type": family, **_BASE, **TINY[family], **overrides}


def _tokenizer(vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer)
    return tok


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        if p.ndim == 3:  # stacked experts [X, out, in]
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[2]))
        elif p.ndim == 2 and "embed" in name:
            p.copy_(torch.randn(p.shape, generator=gen))
        elif p.ndim == 2:
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
        elif name.endswith("bias"):
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        else:  # norm weights: around 1 for Llama-style, around 0 for Gemma's (1 + w)
            p.copy_(0.2 * torch.randn(p.shape, generator=gen) + p)
    for name, b in sorted(model.named_buffers()):
        if name.endswith("e_score_correction_bias"):  # DeepSeek-V3 routing's load-balancing bias (zeros at init)
            b.copy_(0.1 * torch.randn(b.shape, generator=gen))


@torch.no_grad()
def _draw_dt_bias(model: torch.nn.Module, seed: int) -> None:
    """Mamba-2 dt biases as trained models have them (the Mamba-2 init: softplus(dt_bias) log-uniform in
    [1e-3, 0.1]), slow and fast heads, where transformers' Nemotron-H init leaves every one at 1."""
    gen = torch.Generator().manual_seed(seed + 3)
    for name, p in sorted(model.named_parameters()):
        if name.endswith("dt_bias"):
            dt = torch.exp(torch.rand(p.shape, generator=gen) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
            p.copy_(dt + torch.log(-torch.expm1(-dt)))  # the inverse of softplus


def _hf_model(cfg: dict[str, Any]) -> torch.nn.Module:
    """The HF model a tiny checkpoint is saved from: the causal LM, or for a family the hub ships as a
    vision-language wrapper, the wrapper around it (text model under `model.language_model.`)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    family = cfg["model_type"]
    if family not in VISION:
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), dtype=torch.float32)
    text = {**cfg, "model_type": TEXT_MODEL_TYPES[family]}
    vision = {**VISION[family], "out_hidden_size": cfg["hidden_size"]}
    wrapper = AutoConfig.for_model(family, text_config=text, vision_config=vision,
                                   tie_word_embeddings=cfg["tie_word_embeddings"])
    return AutoModelForImageTextToText.from_config(wrapper, dtype=torch.float32)


@torch.no_grad()
def _add_mtp_weights(out: Path, cfg: dict[str, Any], seed: int) -> None:
    """transformers has no MTP module: write the MTP layers as the hub checkpoints lay them out, the
    decoder layers drawn by an HF model of that many layers. Qwen3-Next / Qwen3.5: `mtp.*` (fc, two pre-fc
    norms, full-attention layers `mtp.layers.i`, a norm). DeepSeek-V3: depth k as `model.layers.{N + k}`
    (N = num_hidden_layers), a MoE layer beside `eh_proj`, `enorm`, `hnorm`, `shared_head.norm` and the
    copies of the embedding and LM head that the hub files carry (`embed_tokens`, `shared_head.head`)."""
    import tempfile

    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    family = cfg["model_type"]
    deepseek = family == "deepseek_v3"
    n, first = int(cfg[MTP_FIELDS[family]]), cfg["num_hidden_layers"]
    one = {**cfg, "model_type": TEXT_MODEL_TYPES.get(family, family), "num_hidden_layers": n}
    if deepseek:
        one["first_k_dense_replace"] = 0  # MoE, as the main layers past the dense ones
    else:
        one["layer_types"] = ["full_attention"] * n
    if "mlp_only_layers" in cfg:
        one["mlp_only_layers"] = []
    layer_model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**one), dtype=torch.float32)
    _randomize(layer_model, seed + 1)
    gen = torch.Generator().manual_seed(seed + 2)
    e = cfg["hidden_size"]
    tensors = load_file(out / "model.safetensors")
    with tempfile.TemporaryDirectory() as tmp:
        layer_model.save_pretrained(tmp, safe_serialization=True)
        for name, t in load_file(Path(tmp) / "model.safetensors").items():
            if name.startswith("model.layers."):
                i, rest = name.removeprefix("model.layers.").split(".", 1)
                tensors[f"model.layers.{first + int(i)}.{rest}" if deepseek else f"mtp.layers.{i}.{rest}"] = t
    if deepseek:
        head = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])
        for k in range(n):
            layer = f"model.layers.{first + k}."
            tensors[layer + "eh_proj.weight"] = torch.randn(e, 2 * e, generator=gen) / math.sqrt(2 * e)
            for norm in ("enorm", "hnorm", "shared_head.norm"):
                tensors[f"{layer}{norm}.weight"] = 1 + 0.2 * torch.randn(e, generator=gen)
            tensors[layer + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
            tensors[layer + "shared_head.head.weight"] = head.clone()
    else:
        tensors["mtp.fc.weight"] = torch.randn(e, 2 * e, generator=gen) / math.sqrt(2 * e)
        for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):  # Gemma-style: scale 1 + w
            tensors[f"mtp.{norm}.weight"] = 0.2 * torch.randn(e, generator=gen)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})


def write_tiny_checkpoint(out_dir: str | Path, family: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    """Write a random-weight HF checkpoint dir (config, safetensors, tokenizer) and return its path."""
    from transformers import PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    cfg = tiny_config(family, **overrides)
    assert cfg["model_type"] in FAMILIES
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = _hf_model(cfg)
    _randomize(model, seed)
    if cfg["model_type"] == "nemotron_h":
        _draw_dt_bias(model, seed)
    model.save_pretrained(out, safe_serialization=True)
    if cfg.get(MTP_FIELDS.get(cfg["model_type"], "")):
        _add_mtp_weights(out, cfg, seed)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=_tokenizer(cfg["vocab_size"]),
        bos_token="<s>", eos_token="<|im_end|>", pad_token="<pad>",
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(out)
    # The chat end token ends generation, as in SmolLM2's generation_config.
    eos = [cfg["eos_token_id"], tok.convert_tokens_to_ids("<|im_end|>")]
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": eos}))
    return out
