import json

import pytest

from firstlight.sim.model import ModelConfigError, load_model, model_from_config

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 100}


def test_tiny_dense_hand_count():
    m = model_from_config(TINY)
    head_dim = 16
    attn = 64 * (4 + 2 * 2) * head_dim + 4 * head_dim * 64  # qkv + o
    mlp = 3 * 64 * 128  # gate, up, down
    per_layer = attn + mlp + 2 * 64  # + two RMSNorm weights
    assert m.num_params() == 2 * per_layer + 2 * 100 * 64 + 64
    assert m.kv_bytes_per_token() == 2 * 2 * 2 * head_dim * 2  # layers * (k+v) * kv_heads * d * bf16
    assert m.flops_per_token(0) == pytest.approx(2 * (m.num_params() - 100 * 64))
    # attention adds 2*H*(d_qk+d_v) per key per layer
    assert m.flops_per_token(10) - m.flops_per_token(0) == pytest.approx(2 * 2 * 4 * 32 * 10)


def test_published_parameter_counts():
    assert load_model("llama-2-7b").num_params() == 6_738_415_616  # HF model card: 6.74B
    assert load_model("llama-3.1-8b").num_params() == 8_030_261_248  # 8.03B
    mix = load_model("mixtral-8x7b")
    assert mix.num_params() / 1e9 == pytest.approx(46.7, abs=0.05)  # Mistral: 46.7B total
    assert mix.num_active_params() / 1e9 == pytest.approx(12.9, abs=0.05)  # 12.9B active
    ds = load_model("deepseek-v3")
    assert ds.num_params() / 1e9 == pytest.approx(671, abs=1)  # DeepSeek-V3 report: 671B (w/o MTP)
    assert ds.num_active_params() / 1e9 == pytest.approx(37, abs=1)  # 37B activated
    qw = load_model("qwen1.5-moe-a2.7b")
    assert qw.num_params() / 1e9 == pytest.approx(14.3, abs=0.1)
    assert qw.num_active_params() / 1e9 == pytest.approx(2.7, abs=0.1)


def test_kv_bytes_gqa_and_mla():
    assert load_model("llama-3.1-70b").kv_bytes_per_token() == 80 * 2 * 8 * 128 * 2
    ds = load_model("deepseek-v3")
    assert ds.kv_bytes_per_token() == 61 * (512 + 64) * 2  # latent + rope key, one copy per layer
    assert ds.groups[0].attention.is_mla


def test_sliding_window_caps_kv():
    m = load_model("mistral-7b-v0.1")
    assert m.kv_bytes_for_context(10_000) == m.kv_bytes_for_context(4096)
    g = load_model("gemma-2-9b")
    windows = sorted((x.attention.sliding_window or 0, x.num_layers) for x in g.groups)
    assert windows == [(0, 21), (4096, 21)]
    full = g.kv_bytes_per_token()
    assert g.kv_bytes_for_context(8192) == pytest.approx(full * 4096 + full / 2 * 4096)


def test_moe_groups_first_dense_layers():
    ds = load_model("deepseek-v3")
    dense = [x for x in ds.groups if x.moe is None]
    moe = [x for x in ds.groups if x.moe is not None]
    assert sum(x.num_layers for x in dense) == 3 and sum(x.num_layers for x in moe) == 58
    assert moe[0].moe.shared_linears  # one shared expert


def test_bad_config_names_the_key():
    bad = dict(TINY)
    del bad["num_attention_heads"]
    with pytest.raises(ModelConfigError, match="num_attention_heads"):
        model_from_config(bad)
    with pytest.raises(ModelConfigError, match="no such config.json"):
        load_model("/nonexistent/config.json")


QWEN3_NEXT = {"model_type": "qwen3_next", "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 16,
              "num_key_value_heads": 2, "head_dim": 256, "vocab_size": 151936, "intermediate_size": 5120,
              "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
              "shared_expert_intermediate_size": 512, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
              "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
              "full_attention_interval": 4, "torch_dtype": "bfloat16"}


def test_qwen3_next_hybrid_is_priced_from_its_config():
    from firstlight.sim.model import model_from_config

    m = model_from_config(QWEN3_NEXT)
    linear = [g for g in m.groups if g.linear]
    assert sum(g.num_layers for g in linear) == 36  # 3 of every 4 layers
    # KV only for the 12 full-attention layers: 2 (K, V) x 2 heads x 256 dims x 2 bytes each
    assert m.kv_bytes_per_token() == 12 * 2 * 2 * 256 * 2
    # state per sequence: per linear layer 32 x 128 x 128 delta-rule + conv (2*16*128 + 32*128) x 3, fp32
    assert m.state_bytes_per_seq() == 36 * (32 * 128 * 128 + (2 * 16 * 128 + 32 * 128) * 3) * 4
    # Qwen3-Next-80B-A3B: ~80B total, ~3B active
    assert 75e9 < m.num_params() < 85e9 and 2.5e9 < m.num_active_params() < 4e9
    # the scan is counted per token, independent of context; attention only over full layers
    assert m.flops_per_token(1000) - m.flops_per_token(0) == 12 * 2 * 16 * (256 + 256) * 1000


def test_qwen3_next_step_has_a_scan_op_and_no_kv_for_linear_layers():
    from firstlight.core.hardware import load_spec
    from firstlight.sim.cost import CostModel
    from firstlight.sim.model import model_from_config
    from firstlight.sim.parallel import ParallelConfig

    cm = CostModel(model_from_config(QWEN3_NEXT), load_spec("h100"), ParallelConfig())
    ops = cm.attention_ops(num_decode=32, decode_ctx_sum=32 * 4096, prefill_chunks=[])
    names = [o.name for o in ops]
    assert names.count("linear_attention_scan") == 1 and names.count("attention") == 1
    scan = next(o for o in ops if o.name == "linear_attention_scan")
    assert scan.time_s > 0 and scan.bytes > 0


# Qwen3.5-35B-A3B's config.json as the hub ships it: a vision-language wrapper around the text model
QWEN3_5_MOE = {"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
               "text_config": {"model_type": "qwen3_5_moe_text", "hidden_size": 2048, "num_hidden_layers": 40,
                               "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
                               "vocab_size": 248320, "num_experts": 256, "num_experts_per_tok": 8,
                               "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
                               "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
                               "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
                               "layer_types": ["linear_attention"] * 3 * 10 + ["full_attention"] * 10,
                               "mtp_num_hidden_layers": 1, "dtype": "bfloat16",
                               "rope_parameters": {"rope_type": "default", "rope_theta": 10000000,
                                                   "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                                                   "mrope_interleaved": True}},
               "vision_config": {"model_type": "qwen3_5_moe_vision", "depth": 27, "hidden_size": 1152}}


def test_qwen3_5_moe_is_priced_from_its_text_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(QWEN3_5_MOE))
    m = load_model(path)
    assert m == model_from_config(QWEN3_5_MOE, name=m.name)
    assert sum(g.num_layers for g in m.groups if g.linear) == 30 and all(g.moe for g in m.groups)
    # KV only for the 10 full-attention layers: 2 (K, V) x 2 heads x 256 dims x 2 bytes each
    assert m.kv_bytes_per_token() == 10 * 2 * 2 * 256 * 2
    assert m.state_bytes_per_seq() == 30 * (32 * 128 * 128 + (2 * 16 * 128 + 32 * 128) * 3) * 4
    # ~35B total, ~3B active (8 of 256 experts + the shared one); the vision tower is not priced
    assert 33e9 < m.num_params() < 37e9 and 2.5e9 < m.num_active_params() < 4e9
    # the attention output gate doubles q_proj: the per-token FLOPs of a full layer see it
    attn = next(g for g in m.groups if not g.linear)
    assert attn.attn_linears[0].out_features == (16 + 16 + 2 * 2) * 256


def test_unknown_layer_type_is_named():
    import pytest

    from firstlight.sim.model import ModelConfigError, model_from_config

    with pytest.raises(ModelConfigError, match=r"unknown type\(s\) \['mamba'\]"):
        model_from_config({**QWEN3_NEXT, "num_hidden_layers": 2, "layer_types": ["mamba", "full_attention"]})
