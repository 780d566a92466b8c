"""GGUF file -> HF-format checkpoint dir (config.json, model.safetensors, tokenizer, generation config).

A GGUF (llama.cpp's format) holds quantized weights under llama.cpp's tensor names and the model's
hyper-parameters and tokenizer as metadata. `gguf_to_checkpoint` dequantizes every tensor with the
`gguf` package, renames it to the transformers name, undoes the transforms llama.cpp's
`convert_hf_to_gguf.py` applied on the way in, and writes a directory that transformers (and
`firstlight.models.loader`) reads like any hub checkpoint:

- llama / mistral: Q and K rows were permuted so that llama.cpp's interleaved ("normal") rope
  matches HF's rotate-half rope (`LlamaModel.permute` in convert_hf_to_gguf.py); we apply the
  inverse permutation.
- gemma3: every `*norm.weight` was stored as (w + 1), since Gemma's RMSNorm multiplies by (1 + w)
  and llama.cpp's multiplies by w (`Gemma3Model.modify_tensors`, `norm_shift`); we subtract 1 in fp32.
- qwen2 / qwen3 use HF's rope layout already (NEOX rope in llama.cpp): no permutation.
- Mixture of experts (`Qwen2MoeModel.modify_tensors` for qwen2moe / qwen3moe, `LlamaModel.modify_tensors`
  for Mixtral, which llama.cpp writes as arch llama with `llama.expert_count`): the per-expert HF
  tensors were stacked into one [X, out, in] tensor per projection (`ffn_{gate,up,down}_exps`;
  Mixtral's w1 / w3 / w2); we split them back into the per-expert files transformers writes
  (`mlp.experts.{i}.gate_proj`, `block_sparse_moe.experts.{i}.w1`, ...). Mixtral's Q/K are permuted
  as llama's. The router is `ffn_gate_inp`; Qwen2-MoE's shared expert is `ffn_{gate,up,down}_shexp`
  behind `ffn_gate_inp_shexp` (stored 1-D by some quantizers; HF's is [1, E]). llama.cpp
  renormalizes the top-k router weights for qwen3moe and not for qwen2moe (src/models/qwen*moe.cpp:
  the `norm_w` argument of `build_moe_ffn`), which becomes `norm_topk_prob`.

The tokenizer is rebuilt from the GGUF metadata by transformers' own GGUF tokenizer conversion
(`AutoTokenizer.from_pretrained(dir, gguf_file=...)`), so it encodes exactly as transformers'
GGUF tokenizer does; we save its `tokenizer.json` and write `tokenizer_config.json` with the chat
template and special tokens.

The dir is written atomically: into a temp dir beside `out_dir`, renamed into place at the end.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from firstlight.errors import ModelLoadError, NoSpaceError, UnknownModelError
from firstlight.models.hf_names import expert_file_names, router_file_name
from firstlight.models.hub import check_free_space

# GGUF `general.architecture` values we convert, and the HF model_type each becomes.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "llama": "llama",  # also Mistral, which llama.cpp writes as arch "llama"
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3": "gemma3_text",
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
}
# llama with `llama.expert_count` > 0 is Mixtral; other architectures with experts are refused.
MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}  # fmt: skip

# llama.cpp tensor name (inside blk.N.) -> HF name (inside model.layers.N.), per family.
_DENSE_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GEMMA3_BLOCK = {
    **_DENSE_BLOCK,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# MoE layers: the stacked experts (index into the family's (gate, up, down) file names) and the rest
_EXPERTS = {"ffn_gate_exps": 0, "ffn_up_exps": 1, "ffn_down_exps": 2}
_SHARED_EXPERT = {
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)\.(weight|bias)$")
_OLD_EXPERT_RE = re.compile(r"ffn_(gate|up|down)\.(\d+)")  # one tensor per expert, before llama.cpp stacked them
_TOP_RE = re.compile(r"^(token_embd|output_norm|output)\.(weight|bias)$")

# Tensors llama.cpp may add that carry no HF weight. rope_freqs (Llama-3 rope scaling) is refused below.
_IGNORED_TENSORS = {"rope_factors_long.weight", "rope_factors_short.weight"}


# ----------------------------------------------------------------------------------------------
# reading


def _open(gguf_path: Path) -> Any:
    """A GGUFReader, with a missing, truncated or corrupt file turned into a ModelLoadError."""
    from gguf import GGUFReader

    path = Path(gguf_path)
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} does not exist; pass the path of a .gguf file")
    try:
        reader = GGUFReader(path)
        size = path.stat().st_size
        for t in reader.tensors:
            if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
                raise ValueError(f"tensor {t.name} extends past the end of the file")
    except Exception as e:  # numpy, struct and the gguf package each fail their own way on bad bytes
        raise ModelLoadError(
            f"{path} is not a readable GGUF file (truncated or corrupt: {type(e).__name__}: {_one_line(e)}); "
            "re-download it or re-run `firstlight models pull NAME --force`"
        ) from e
    return reader


def read_metadata(reader: Any) -> dict[str, Any]:
    """Scalar and string metadata as plain Python values; long arrays (the vocab) are left out."""
    meta: dict[str, Any] = {}
    for key, f in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key.endswith(("tokens", "scores", "token_type", "merges")):
            meta[key] = len(f.data)  # just the count; transformers reads these itself
            continue
        try:
            meta[key] = f.contents()
        except Exception as e:  # a field the gguf package cannot decode
            raise ModelLoadError(
                f"GGUF metadata field {key} cannot be decoded ({e}); the file is corrupt"
            ) from e
    return meta


def _architecture(meta: dict[str, Any], path: Path) -> str:
    arch = meta.get("general.architecture")
    num_experts = _expert_count(meta, arch)
    supported = (
        f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))} (Mixtral is llama with experts)"
    )
    if arch not in SUPPORTED_ARCHITECTURES:
        kind = f" (a mixture of experts: {arch}.expert_count = {num_experts})" if num_experts else ""
        raise UnknownModelError(f"{path}: GGUF architecture '{arch}'{kind} is not supported; {supported}")
    if num_experts and arch not in ("llama", "qwen2moe", "qwen3moe"):
        raise UnknownModelError(
            f"{path}: GGUF architecture '{arch}' with experts ({arch}.expert_count = {num_experts}) is not "
            f"supported; {supported}"
        )
    return str(arch)


def _expert_count(meta: dict[str, Any], arch: Any) -> int:
    value = meta.get(f"{arch}.expert_count") or 0
    try:
        return int(value)
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"GGUF metadata {arch}.expert_count = {value!r} is not a count") from e


def model_type_of(meta: dict[str, Any]) -> str:
    """The HF model_type a (supported) GGUF becomes."""
    arch = str(meta["general.architecture"])
    if arch == "llama" and _expert_count(meta, arch):
        return "mixtral"
    if arch == "llama" and "mistral" in str(meta.get("general.name", "")).lower():
        return "mistral"  # llama.cpp writes Mistral as llama; transformers keys on the name too
    return SUPPORTED_ARCHITECTURES[arch]


# ----------------------------------------------------------------------------------------------
# config


def build_config(meta: dict[str, Any], tensor_names: list[str], dtype: str = "float32") -> dict[str, Any]:
    """HF config.json dict from GGUF metadata (classic keys, plus transformers-5 `rope_parameters`)."""
    arch = str(meta["general.architecture"])
    model_type = model_type_of(meta)

    def key(k: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{k}", default)

    def required(k: str) -> Any:
        if f"{arch}.{k}" not in meta:
            raise ModelLoadError(
                f"GGUF metadata lacks {arch}.{k}; the file is incomplete or not a {arch} model"
            )
        return meta[f"{arch}.{k}"]

    hidden = int(required("embedding_length"))
    num_heads = int(required("attention.head_count"))
    kv = required("attention.head_count_kv") if f"{arch}.attention.head_count_kv" in meta else num_heads
    if isinstance(kv, list):  # per-layer kv heads (llama.cpp allows it); dense models have one value
        if len(set(kv)) != 1:
            raise ModelLoadError(f"GGUF has per-layer kv head counts {kv}; only uniform counts are supported")
        kv = kv[0]
    head_dim = int(key("attention.key_length") or key("rope.dimension_count") or hidden // num_heads)
    vocab = key("vocab_size") or meta.get("tokenizer.ggml.tokens")
    if not vocab:
        raise ModelLoadError("GGUF metadata has neither a vocab_size nor a token list")
    num_layers = int(required("block_count"))
    theta = float(key("rope.freq_base", 10000.0))
    tie = "output.weight" not in tensor_names

    if "rope_freqs.weight" in tensor_names:
        raise ModelLoadError(
            "GGUF stores Llama-3 rope scaling only as a rope_freqs tensor, from which firstlight does not "
            "recover the HF rope_scaling parameters; convert from the HF checkpoint instead"
        )
    rope_scaling = None
    scaling_type = key("rope.scaling.type")
    if scaling_type not in (None, "none"):
        if scaling_type != "linear":
            raise ModelLoadError(
                f"GGUF rope scaling type '{scaling_type}' is not supported; supported: linear"
            )
        rope_scaling = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}

    cfg: dict[str, Any] = {
        "architectures": [_ARCH_CLASS[model_type]],
        "model_type": model_type,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(
            key("feed_forward_length") or required("expert_feed_forward_length")
            if model_type in MOE_MODEL_TYPES else required("feed_forward_length")
        ),
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(kv),
        "head_dim": head_dim,
        "max_position_embeddings": int(key("context_length", 2048)),
        "rms_norm_eps": float(required("attention.layer_norm_rms_epsilon")),
        "rope_theta": theta,
        "rope_scaling": rope_scaling,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta, **(rope_scaling or {})},
        "tie_word_embeddings": tie,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": dtype,
        "use_cache": True,
    }
    has_qkv_bias = any(n.endswith("attn_q.bias") for n in tensor_names)
    if model_type in ("llama", "mistral"):
        cfg.update(hidden_act="silu", attention_bias=has_qkv_bias, mlp_bias=False)
    if model_type == "mistral":
        cfg["sliding_window"] = key("attention.sliding_window")
    if model_type == "qwen2":
        cfg.update(hidden_act="silu", use_sliding_window=False, sliding_window=None)
        del cfg["head_dim"]  # Qwen2Config derives it as hidden_size // num_attention_heads
        if head_dim != hidden // num_heads:
            raise ModelLoadError(f"qwen2 GGUF has head_dim {head_dim} != hidden/heads {hidden // num_heads}")
    if model_type == "qwen3":
        cfg.update(
            hidden_act="silu", attention_bias=has_qkv_bias, use_sliding_window=False, sliding_window=None
        )
    if model_type == "gemma3_text":
        cfg.update(_gemma3_fields(meta, arch, num_layers, hidden, num_heads, head_dim, theta, rope_scaling))
    if model_type in MOE_MODEL_TYPES:
        cfg.update(_moe_fields(meta, arch, model_type, num_layers, tensor_names, has_qkv_bias))
    return cfg


def _moe_fields(
    meta: dict[str, Any], arch: str, model_type: str, num_layers: int, tensor_names: list[str], qkv_bias: bool,
) -> dict[str, Any]:  # fmt: skip
    """Expert counts and sizes from `{arch}.expert_*`; which layers are sparse from the tensors (a layer
    with a router `blk.N.ffn_gate_inp` is; llama.cpp's own loaders require every layer to be)."""
    num_experts = _expert_count(meta, arch)
    used = meta.get(f"{arch}.expert_used_count")
    if not num_experts or used is None:
        raise ModelLoadError(
            f"GGUF metadata lacks {arch}.expert_count or {arch}.expert_used_count; the file is incomplete"
        )
    gating = meta.get(f"{arch}.expert_gating_func")
    if gating not in (None, 1):  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
        raise ModelLoadError(
            f"GGUF {arch}.expert_gating_func = {gating}: only softmax routing (1) is supported for {arch}"
        )
    names = set(tensor_names)
    dense = [i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in names]
    if model_type == "mixtral":
        if dense:
            raise ModelLoadError(
                f"GGUF llama with experts (Mixtral) has no router in layer {dense[0]}; every Mixtral layer is sparse"
            )
        # Mixtral's experts are `feed_forward_length` wide (llama.cpp writes no expert length for it)
        ff = meta.get(f"{arch}.expert_feed_forward_length") or meta.get(f"{arch}.feed_forward_length")
        return {"num_local_experts": num_experts, "num_experts_per_tok": int(used), "intermediate_size": int(ff),
                "hidden_act": "silu", "sliding_window": meta.get(f"{arch}.attention.sliding_window"),
                "router_jitter_noise": 0.0}  # fmt: skip
    expert_ff = meta.get(f"{arch}.expert_feed_forward_length")
    if expert_ff is None:
        raise ModelLoadError(f"GGUF metadata lacks {arch}.expert_feed_forward_length; the file is incomplete")
    fields: dict[str, Any] = {
        "num_experts": num_experts,
        "num_experts_per_tok": int(used),
        "moe_intermediate_size": int(expert_ff),
        "norm_topk_prob": model_type == "qwen3_moe",  # llama.cpp's norm_w for qwen3moe / qwen2moe
        "decoder_sparse_step": 1,
        "mlp_only_layers": dense,
        "hidden_act": "silu",
        "use_sliding_window": False,
        "sliding_window": None,
    }
    if model_type == "qwen2_moe":
        shared = meta.get(f"{arch}.expert_shared_feed_forward_length")
        if shared is None:
            raise ModelLoadError(
                f"GGUF metadata lacks {arch}.expert_shared_feed_forward_length; the file is incomplete"
            )
        fields.update(shared_expert_intermediate_size=int(shared), qkv_bias=qkv_bias)
    else:
        fields["attention_bias"] = qkv_bias
    return fields


_ARCH_CLASS = {
    "llama": "LlamaForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}


def _gemma3_fields(
    meta: dict[str, Any], arch: str, num_layers: int, hidden: int, num_heads: int, head_dim: int,
    theta: float, rope_scaling: dict[str, Any] | None,
) -> dict[str, Any]:  # fmt: skip
    """Gemma 3 fields that GGUF does not store; llama.cpp (src/llama-model.cpp, LLM_ARCH_GEMMA3)
    hard-codes them, and so do we: a 5 local : 1 global layer pattern, a 10k rope base on local
    layers, and attention scaled by head_dim**-0.5 except for the 27B (62 layers), which uses
    (hidden/heads)**-0.5."""
    pattern = 6
    window = meta.get(f"{arch}.attention.sliding_window")
    if window is None:
        raise ModelLoadError(f"GGUF metadata lacks {arch}.attention.sliding_window; the file is incomplete")
    local_theta = float(meta.get(f"{arch}.rope.freq_base_swa", 10000.0))
    layer_types = [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)
    ]
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": hidden // num_heads if num_layers == 62 else head_dim,
        "sliding_window": int(window),
        "sliding_window_pattern": pattern,
        "layer_types": layer_types,
        "rope_local_base_freq": local_theta,
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": theta, **(rope_scaling or {})},
            "sliding_attention": {"rope_type": "default", "rope_theta": local_theta},
        },
        "final_logit_softcapping": meta.get(f"{arch}.final_logit_softcapping"),
        "attn_logit_softcapping": meta.get(f"{arch}.attn_logit_softcapping"),
        "attention_bias": False,
    }


def expected_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape, for every tensor a checkpoint of this config must hold."""
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // heads
    inter, vocab, mt = cfg["intermediate_size"], cfg["vocab_size"], cfg["model_type"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (vocab, h)
    for i in range(layers):
        p = f"model.layers.{i}."
        layer = {
            "self_attn.q_proj.weight": (heads * d, h),
            "self_attn.k_proj.weight": (kv * d, h),
            "self_attn.v_proj.weight": (kv * d, h),
            "self_attn.o_proj.weight": (h, heads * d),
            "mlp.gate_proj.weight": (inter, h),
            "mlp.up_proj.weight": (inter, h),
            "mlp.down_proj.weight": (h, inter),
            "input_layernorm.weight": (h,),
            "post_attention_layernorm.weight": (h,),
        }
        if mt == "qwen2" or cfg.get("attention_bias") or (mt == "qwen2_moe" and cfg.get("qkv_bias", True)):
            layer.update({"self_attn.q_proj.bias": (heads * d,), "self_attn.k_proj.bias": (kv * d,),
                          "self_attn.v_proj.bias": (kv * d,)})  # fmt: skip
        if mt in ("qwen3", "qwen3_moe", "gemma3_text"):
            layer.update({"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)})
        if mt == "gemma3_text":
            layer.update(
                {"pre_feedforward_layernorm.weight": (h,), "post_feedforward_layernorm.weight": (h,)}
            )
        if mt in MOE_MODEL_TYPES and i not in set(cfg.get("mlp_only_layers") or ()):
            for k in ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"):
                del layer[k]
            layer.update(_moe_shapes(cfg, h))
        shapes.update({p + k: v for k, v in layer.items()})
    return shapes


def _moe_shapes(cfg: dict[str, Any], h: int) -> dict[str, tuple[int, ...]]:
    """One sparse layer's tensors (inside model.layers.N), in the per-expert file layout."""
    mt = cfg["model_type"]
    num_experts = cfg["num_local_experts"] if mt == "mixtral" else cfg["num_experts"]
    inter = cfg["intermediate_size"] if mt == "mixtral" else cfg["moe_intermediate_size"]
    gate, up, down = expert_file_names(mt)
    shapes = {f"{router_file_name(mt)}.weight": (num_experts, h)}
    for e in range(num_experts):
        shapes.update({f"{gate.format(i=e)}.weight": (inter, h), f"{up.format(i=e)}.weight": (inter, h),
                       f"{down.format(i=e)}.weight": (h, inter)})  # fmt: skip
    shared = cfg.get("shared_expert_intermediate_size") or 0
    if mt == "qwen2_moe" and shared:
        shapes.update({"mlp.shared_expert.gate_proj.weight": (shared, h), "mlp.shared_expert.up_proj.weight": (shared, h),
                       "mlp.shared_expert.down_proj.weight": (h, shared), "mlp.shared_expert_gate.weight": (1, h)})  # fmt: skip
    return shapes


# ----------------------------------------------------------------------------------------------
# tensors


def hf_name(gguf_name: str, model_type: str) -> str | None:
    """The transformers name of a GGUF tensor, or None if it has none (stacked experts: see `expert_names`)."""
    if m := _TOP_RE.match(gguf_name):
        return f"{_TOP[m.group(1)]}.{m.group(2)}"
    if m := _BLOCK_RE.match(gguf_name):
        block = _GEMMA3_BLOCK if model_type == "gemma3_text" else _DENSE_BLOCK
        if model_type in MOE_MODEL_TYPES:
            block = {**block, "ffn_gate_inp": router_file_name(model_type)}
            if model_type == "qwen2_moe":
                block.update(_SHARED_EXPERT)
        if m.group(2) in block:
            return f"model.layers.{m.group(1)}.{block[m.group(2)]}.{m.group(3)}"
        if model_type in MOE_MODEL_TYPES and (e := _OLD_EXPERT_RE.fullmatch(m.group(2))):
            # llama.cpp before stacked experts (early Mixtral files): blk.N.ffn_{gate,up,down}.E.weight
            template = expert_file_names(model_type)[_EXPERTS[f"ffn_{e.group(1)}_exps"]]
            return f"model.layers.{m.group(1)}.{template.format(i=int(e.group(2)))}.{m.group(3)}"
    return None


def expert_names(gguf_name: str, model_type: str, num_experts: int) -> list[str] | None:
    """The per-expert transformers names a stacked `blk.N.ffn_*_exps.weight` splits into, or None."""
    m = _BLOCK_RE.match(gguf_name)
    if m is None or model_type not in MOE_MODEL_TYPES or m.group(2) not in _EXPERTS or m.group(3) != "weight":
        return None
    template = expert_file_names(model_type)[_EXPERTS[m.group(2)]]
    return [f"model.layers.{m.group(1)}.{template.format(i=e)}.weight" for e in range(num_experts)]


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's `LlamaModel.permute` (convert_hf_to_gguf.py), for a q or k weight/bias
    of `n_head` heads: GGUF rows are ordered per head as (dim/2, 2), HF's as (2, dim/2)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _transform(model_type: str, cfg: dict[str, Any]) -> Callable[[str, np.ndarray], np.ndarray]:
    """The per-tensor fix-up that undoes llama.cpp's conversion for this family (fp32 in, fp32 out)."""

    def fix(name: str, w: np.ndarray) -> np.ndarray:
        if model_type in ("llama", "mistral", "mixtral"):
            if ".self_attn.q_proj." in name:
                return unpermute_qk(w, cfg["num_attention_heads"])
            if ".self_attn.k_proj." in name:
                return unpermute_qk(w, cfg["num_key_value_heads"])
        if model_type == "gemma3_text" and name.endswith("norm.weight"):
            return w - np.float32(1.0)
        if name.endswith(".shared_expert_gate.weight") and w.ndim == 1:
            return w[None]  # stored 1-D by some quantizers; HF's is [1, E]
        return w

    return fix


def convert_tensors(reader: Any, cfg: dict[str, Any], dtype: str = "float32") -> dict[str, Any]:
    """HF name -> torch tensor in `dtype`: dequantized, renamed, un-permuted, shape-checked."""
    import torch
    from gguf import quants

    torch_dtype = getattr(torch, dtype)
    fix = _transform(cfg["model_type"], cfg)
    want = expected_shapes(cfg)
    num_experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        if t.name in _IGNORED_TENSORS:
            continue
        experts = expert_names(t.name, cfg["model_type"], num_experts)
        name = experts[0] if experts else hf_name(t.name, cfg["model_type"])
        if name is None or name not in want:
            raise ModelLoadError(
                f"GGUF tensor {t.name} has no place in a {cfg['model_type']} checkpoint of this config; "
                "the file is not a plain model of its stated architecture"
            )
        try:
            w = quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise ModelLoadError(
                f"GGUF tensor {t.name} uses quantization {t.tensor_type.name}, which the gguf package "
                f"cannot dequantize ({e}); upgrade `gguf` or use another quantization"
            ) from e
        w = np.asarray(w, dtype=np.float32)
        if experts:  # [X, out, in] -> one tensor per expert (copies: safetensors refuses shared storage)
            shape = (len(experts), *want[name])
            if tuple(w.shape) != shape:
                raise ModelLoadError(
                    f"GGUF tensor {t.name} has shape {tuple(w.shape)} but the config implies {shape} "
                    f"({len(experts)} experts)"
                )
            for e, expert in enumerate(experts):
                out[expert] = torch.from_numpy(np.array(w[e], order="C")).to(torch_dtype)
            continue
        w = fix(name, w)
        if tuple(w.shape) != want[name]:
            raise ModelLoadError(
                f"GGUF tensor {t.name} ({name}) has shape {tuple(w.shape)} but the config implies {want[name]}"
            )
        if not (w.flags.writeable and w.flags.c_contiguous):  # F32 tensors are read-only views of the file
            w = np.array(w, order="C")
        out[name] = torch.from_numpy(w).to(torch_dtype)
    missing = sorted(set(want) - set(out))
    if missing:
        raise ModelLoadError(
            f"GGUF lacks {len(missing)} tensor(s) a {cfg['model_type']} checkpoint needs, e.g. {missing[0]}"
        )
    return out


# ----------------------------------------------------------------------------------------------
# tokenizer


def write_tokenizer(gguf_path: Path, out_dir: Path, meta: dict[str, Any], max_length: int) -> None:
    """tokenizer.json + tokenizer_config.json, built by transformers' GGUF tokenizer conversion."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as e:  # transformers raises ValueError/KeyError/... for vocabularies it cannot build
        raise ModelLoadError(
            f"{gguf_path}: transformers cannot build a tokenizer from this GGUF ({type(e).__name__}: {_one_line(e)})"
        ) from e
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        tok.save_pretrained(tmp)
        shutil.move(os.path.join(tmp, "tokenizer.json"), out_dir / "tokenizer.json")
        saved = json.loads(Path(tmp, "tokenizer_config.json").read_text())
    for k in ("is_local", "local_files_only", "chat_template"):
        saved.pop(k, None)
    saved.update(
        model_max_length=max_length,
        # llama.cpp (and transformers) add BOS for a sentencepiece vocab whose file has no flag
        add_bos_token=bool(
            meta.get("tokenizer.ggml.add_bos_token", meta.get("tokenizer.ggml.model") == "llama")
        ),
        add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        clean_up_tokenization_spaces=False,
    )
    template = meta.get("tokenizer.chat_template")
    if template:
        saved["chat_template"] = template
    _write_json(out_dir / "tokenizer_config.json", saved)


def generation_config(cfg: dict[str, Any], meta: dict[str, Any], eot_ids: list[int]) -> dict[str, Any]:
    """Stop on eos and on the end-of-turn token(s) llama.cpp marks (eot id, Gemma's <end_of_turn>)."""
    eos = [cfg["eos_token_id"]] if cfg.get("eos_token_id") is not None else []
    for i in eot_ids:
        if i is not None and i not in eos:
            eos.append(int(i))
    gen: dict[str, Any] = {"bos_token_id": cfg.get("bos_token_id"), "pad_token_id": cfg.get("pad_token_id")}
    gen["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    return gen


def _eot_ids(reader: Any, meta: dict[str, Any]) -> list[int]:
    ids = [meta.get("tokenizer.ggml.eot_token_id")]
    if meta.get("general.architecture") == "gemma3" and "tokenizer.ggml.tokens" in reader.fields:
        f = reader.fields["tokenizer.ggml.tokens"]
        # Gemma's chat turns end with <end_of_turn>; llama.cpp treats it as end-of-generation too.
        for idx, part in enumerate(f.data[:256]):
            if bytes(f.parts[part]) == b"<end_of_turn>":
                ids.append(idx)
    return [int(i) for i in ids if i is not None]


# ----------------------------------------------------------------------------------------------
# the whole conversion


def gguf_to_checkpoint(gguf_path: Path, out_dir: Path, dtype: str = "float32") -> Path:
    """Convert `gguf_path` into an HF-format checkpoint dir at `out_dir` (created; must not exist
    or be empty) and return `out_dir`. dtype: float32 (exact for every GGUF quantization), bfloat16
    or float16."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype '{dtype}' is not supported; use one of {', '.join(DTYPES)}")
    dtype = DTYPES[dtype]
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ModelLoadError(
            f"output dir {out_dir} already exists and is not empty; remove it or pick another"
        )
    reader = _open(gguf_path)
    meta = read_metadata(reader)
    _architecture(meta, gguf_path)
    cfg = build_config(meta, [t.name for t in reader.tensors], dtype)
    tensors = convert_tensors(reader, cfg, dtype)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    need = sum(t.numel() * t.element_size() for t in tensors.values())
    check_free_space(out_dir.parent, need, f"converting {gguf_path.name} to {out_dir.name}")
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        _write_checkpoint(tmp, gguf_path, reader, meta, cfg, tensors)
        _chmod_like_umask(tmp)
        if out_dir.exists():
            out_dir.rmdir()  # empty, checked above
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _write_checkpoint(
    tmp: Path,
    gguf_path: Path,
    reader: Any,
    meta: dict[str, Any],
    cfg: dict[str, Any],
    tensors: dict[str, Any],
) -> None:
    from safetensors.torch import save_file

    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    except Exception as e:  # safetensors reports a full disk as its own error type
        if "No space left on device" in str(e):
            raise NoSpaceError(
                f"the disk of {tmp.parent} filled up while writing {gguf_path.name}'s tensors; free some space, "
                "or point FIRSTLIGHT_HOME (or the output dir) at a disk with more room"
            ) from e
        raise
    del tensors
    _write_json(tmp / "config.json", cfg)
    _write_json(tmp / "generation_config.json", generation_config(cfg, meta, _eot_ids(reader, meta)))
    write_tokenizer(gguf_path, tmp, meta, cfg["max_position_embeddings"])


def _chmod_like_umask(root: Path) -> None:
    """mkdtemp makes a 0700 dir and safetensors a 0600 file; give them the modes a plain mkdir/open would."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(root, 0o777 & ~umask)
    for p in root.iterdir():
        os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~umask)


def _one_line(e: BaseException, limit: int = 200) -> str:
    return " ".join(str(e).split())[:limit]


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
