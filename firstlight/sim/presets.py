"""HF `config.json` contents of well-known models, so the simulator runs without a download.

Only the keys the model description reads are kept; values are copied from the models' published
config.json files on the Hugging Face Hub (repo named in `_name_or_path`).
"""

from __future__ import annotations

from typing import Any

_LLAMA3_8B: dict[str, Any] = {
    "_name_or_path": "meta-llama/Llama-3.1-8B", "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "vocab_size": 128256, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "max_position_embeddings": 131072,
}

_QWEN3: dict[str, Any] = {
    "model_type": "qwen3", "vocab_size": 151936, "head_dim": 128, "num_key_value_heads": 8,
    "torch_dtype": "bfloat16", "max_position_embeddings": 40960, "tie_word_embeddings": False,
}


def _qwen3(repo: str, hidden: int, inter: int, layers: int, heads: int, tie: bool = False) -> dict[str, Any]:
    return {**_QWEN3, "_name_or_path": repo, "hidden_size": hidden, "intermediate_size": inter,
            "num_hidden_layers": layers, "num_attention_heads": heads, "tie_word_embeddings": tie}


def _qwen3_moe(repo: str, hidden: int, inter: int, moe_inter: int, layers: int, heads: int, kv: int) -> dict[str, Any]:
    return {**_QWEN3, "_name_or_path": repo, "model_type": "qwen3_moe", "hidden_size": hidden,
            "intermediate_size": inter, "moe_intermediate_size": moe_inter, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv, "num_experts": 128, "num_experts_per_tok": 8,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "max_position_embeddings": 40960}


# Granite 4.0-H: Mamba-2 layers with an attention (NoPE) layer at 5, 15, 25 and 35 of 40
_GRANITE_4_H: dict[str, Any] = {
    "model_type": "granitemoehybrid", "hidden_size": 1536, "num_hidden_layers": 40, "num_attention_heads": 12,
    "num_key_value_heads": 4, "vocab_size": 100352, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "mamba_d_state": 128, "mamba_n_groups": 1, "mamba_n_heads": 48, "mamba_d_head": 64, "mamba_expand": 2,
    "mamba_d_conv": 4, "mamba_chunk_size": 256, "max_position_embeddings": 131072,
    "position_embedding_type": "nope",
    "layer_types": (["mamba"] * 5 + ["attention"] + (["mamba"] * 9 + ["attention"]) * 3 + ["mamba"] * 4),
}

PRESETS: dict[str, dict[str, Any]] = {
    "llama-2-7b": {
        "_name_or_path": "meta-llama/Llama-2-7b-hf", "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
        "vocab_size": 32000, "torch_dtype": "float16", "max_position_embeddings": 4096,
    },
    "llama-2-70b": {
        "_name_or_path": "meta-llama/Llama-2-70b-hf", "model_type": "llama", "hidden_size": 8192,
        "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
        "vocab_size": 32000, "torch_dtype": "float16", "max_position_embeddings": 4096,
    },
    "llama-2-13b": {
        "_name_or_path": "meta-llama/Llama-2-13b-hf", "model_type": "llama", "hidden_size": 5120,
        "intermediate_size": 13824, "num_hidden_layers": 40, "num_attention_heads": 40, "num_key_value_heads": 40,
        "vocab_size": 32000, "torch_dtype": "float16", "max_position_embeddings": 4096,
    },
    "llama-3.1-8b": _LLAMA3_8B,
    "llama-3.1-70b": {
        **_LLAMA3_8B, "_name_or_path": "meta-llama/Llama-3.1-70B", "hidden_size": 8192, "intermediate_size": 28672,
        "num_hidden_layers": 80, "num_attention_heads": 64,
    },
    "llama-3.1-405b": {
        **_LLAMA3_8B, "_name_or_path": "meta-llama/Llama-3.1-405B", "hidden_size": 16384,
        "intermediate_size": 53248, "num_hidden_layers": 126, "num_attention_heads": 128,
    },
    "mistral-7b-v0.1": {
        "_name_or_path": "mistralai/Mistral-7B-v0.1", "model_type": "mistral", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "vocab_size": 32000, "sliding_window": 4096, "torch_dtype": "bfloat16",
    },
    "mixtral-8x7b": {
        "_name_or_path": "mistralai/Mixtral-8x7B-v0.1", "model_type": "mixtral", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "vocab_size": 32000, "num_local_experts": 8, "num_experts_per_tok": 2, "torch_dtype": "bfloat16",
    },
    "mixtral-8x22b": {
        "_name_or_path": "mistralai/Mixtral-8x22B-v0.1", "model_type": "mixtral", "hidden_size": 6144,
        "intermediate_size": 16384, "num_hidden_layers": 56, "num_attention_heads": 48, "num_key_value_heads": 8,
        "vocab_size": 32768, "num_local_experts": 8, "num_experts_per_tok": 2, "torch_dtype": "bfloat16",
        "max_position_embeddings": 65536,
    },
    "qwen3-0.6b": _qwen3("Qwen/Qwen3-0.6B", 1024, 3072, 28, 16, tie=True),
    "qwen3-1.7b": _qwen3("Qwen/Qwen3-1.7B", 2048, 6144, 28, 16, tie=True),
    "qwen3-4b": _qwen3("Qwen/Qwen3-4B", 2560, 9728, 36, 32, tie=True),
    "qwen3-8b": _qwen3("Qwen/Qwen3-8B", 4096, 12288, 36, 32),
    "qwen3-14b": _qwen3("Qwen/Qwen3-14B", 5120, 17408, 40, 40),
    "qwen3-32b": _qwen3("Qwen/Qwen3-32B", 5120, 25600, 64, 64),
    "qwen3-30b-a3b": _qwen3_moe("Qwen/Qwen3-30B-A3B", 2048, 6144, 768, 48, 32, 4),
    "qwen3-235b-a22b": _qwen3_moe("Qwen/Qwen3-235B-A22B", 4096, 12288, 1536, 94, 64, 4),
    "qwen1.5-moe-a2.7b": {
        "_name_or_path": "Qwen/Qwen1.5-MoE-A2.7B", "model_type": "qwen2_moe", "hidden_size": 2048,
        "intermediate_size": 5632, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
        "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 151936,
        "num_experts": 60, "num_experts_per_tok": 4, "decoder_sparse_step": 1, "torch_dtype": "bfloat16",
    },
    "deepseek-v3": {
        "_name_or_path": "deepseek-ai/DeepSeek-V3", "model_type": "deepseek_v3", "hidden_size": 7168,
        "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
        "num_attention_heads": 128, "num_key_value_heads": 128, "vocab_size": 129280, "n_routed_experts": 256,
        "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "moe_layer_freq": 1,
        "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "torch_dtype": "bfloat16",
    },
    "granite-4.0-h-tiny": {  # 7B total, ~1B active (IBM); 64 experts of 512, top 6, shared MLP 1024
        **_GRANITE_4_H, "_name_or_path": "ibm-granite/granite-4.0-h-tiny", "intermediate_size": 512,
        "shared_intermediate_size": 1024, "num_local_experts": 64, "num_experts_per_tok": 6,
    },
    "granite-4.0-h-1b": {  # the dense twin: ~1.5B, no routed experts
        **_GRANITE_4_H, "_name_or_path": "ibm-granite/granite-4.0-h-1b", "intermediate_size": 4096,
        "shared_intermediate_size": 4096, "num_local_experts": 0, "num_experts_per_tok": 0,
    },
    "gemma-2-9b": {
        "_name_or_path": "google/gemma-2-9b", "model_type": "gemma2", "hidden_size": 3584,
        "intermediate_size": 14336, "num_hidden_layers": 42, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 256, "vocab_size": 256000, "sliding_window": 4096, "tie_word_embeddings": True,
        "layer_types": ["sliding_attention", "full_attention"] * 21, "torch_dtype": "bfloat16",
    },
}
