"""DeepSeek-V3: the config's derived fields and its bad inputs named, the checkpoint's names, the MLA cache
(one latent row per token, the same values transformers caches), variants of the layer (no q bottleneck,
plain rope, biases, one expert group) against transformers, the MTP layers the files carry skipped, and a
hub-shaped config agreeing with `firstlight sim`. Logit parity, greedy, incremental and chunked prefill of
the default tiny checkpoint run in test_parity.py with every family."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from firstlight.errors import ModelLoadError
from firstlight.models.config import FULL, ModelConfig
from firstlight.models.hf_names import checkpoint_names, hf_module_name, hf_name
from firstlight.models.kv_cache import ContiguousKVCache
from firstlight.models.loader import load_model
from firstlight.models.tiny import tiny_config, write_tiny_checkpoint
from tests.models.parity import (
    FP32_REL_TOL,
    chunked_prefill_error,
    hf_greedy,
    hf_reference,
    incremental_error,
    logit_errors,
    our_greedy,
)

DS = "deepseek_v3"


def _cfg(**overrides) -> ModelConfig:
    return ModelConfig.from_hf(tiny_config(DS, **overrides))


def test_derived_fields():
    cfg = _cfg()
    mla = cfg.mla
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim) == (
        32, 24, 16, 8, 12)
    assert mla.rope_interleave and mla.qk_head_dim == 24 and mla.cache_width == 32
    # the cache keeps the latent row (24 + 8) in two halves, one "KV head", whatever num_key_value_heads says
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.rope_head_dim) == (1, 16, 8)
    rope = cfg.rope[FULL]
    assert (rope.kind, rope.factor, rope.original_max_position_embeddings) == ("yarn", 4.0, 32)
    mscale = 0.1 * 0.6 * math.log(4.0) + 1.0  # mscale_all_dim's, squared into the softmax scale
    assert cfg.attn_scale == pytest.approx(24**-0.5 * mscale**2, rel=1e-12)
    assert _cfg(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}).attn_scale == pytest.approx(24**-0.5)
    moe = cfg.moe
    assert moe.sparse_layers == (False, True, True, True) and moe.gated_experts and moe.sigmoid_routing
    assert (moe.num_experts, moe.num_experts_per_tok, moe.num_groups, moe.topk_groups) == (8, 3, 4, 2)
    assert (moe.routed_scaling_factor, moe.shared_expert_intermediate_size, moe.experts_field) == (
        2.5, 64, "n_routed_experts")
    assert _cfg(q_lora_rank=None).mla.q_lora_rank is None
    assert _cfg(num_nextn_predict_layers=1).num_mtp_layers == 1


@pytest.mark.parametrize(("overrides", "words"), [
    ({"n_routed_experts": 6}, r"'n_group' \(4\) and 'topk_group' \(2\): n_group must divide n_routed_experts=6"),
    ({"topk_group": 5}, r"'n_group' \(4\) and 'topk_group' \(5\)"),
    ({"num_experts_per_tok": 5}, r"the topk_group kept groups >= num_experts_per_tok experts"),
    ({"n_group": 8}, r"each of the n_group groups of n_routed_experts=8 needs >= 2 experts"),
    ({"num_experts_per_tok": 9}, r"'num_experts_per_tok' \(9\) must lie in \[1, n_routed_experts=8\]"),
    ({"n_routed_experts": 0}, r"'n_routed_experts' must be >= 1"),
    ({"kv_lora_rank": 23}, r"config field 'kv_lora_rank' \(23\) must be even"),
    ({"qk_rope_head_dim": 7}, r"config field 'qk_rope_head_dim' \(7\) must be even"),
    ({"kv_lora_rank": None}, r"kv_lora_rank = None is not an integer"),
    ({"v_head_dim": 0}, r"v_head_dim = 0 must be >= 1"),
    ({"kv_lora_rank": 1 << 20}, r"kv_lora_rank = 1048576 is not a plausible size"),
    ({"first_k_dense_replace": -1}, r"first_k_dense_replace = -1 must be >= 0"),
])
def test_bad_config_is_named(overrides, words):
    with pytest.raises(ModelLoadError, match=words):
        _cfg(**overrides)


def test_missing_latent_rank_is_named():
    cfg = tiny_config(DS)
    del cfg["kv_lora_rank"]
    with pytest.raises(ModelLoadError, match="missing required field 'kv_lora_rank' for model_type 'deepseek_v3'"):
        ModelConfig.from_hf(cfg)


def test_wrong_expert_count_in_a_checkpoint_is_named(tiny_dirs, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_dirs[DS], ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "n_routed_experts": 16}))
    with pytest.raises(ModelLoadError, match="field 'n_routed_experts' is 16 but the checkpoint has 8 experts in layer 1"):
        load_model(ckpt, with_tokenizer=False)


def test_checkpoint_names():
    assert hf_name("layers.1.mlp.shared_experts.gate_up_proj.weight", DS) == [
        "model.layers.1.mlp.shared_experts.gate_proj.weight", "model.layers.1.mlp.shared_experts.up_proj.weight"]
    assert hf_module_name("layers.1.mlp.shared_experts.gate_up_proj", DS) == "model.layers.1.mlp.shared_experts.gate_proj"
    assert hf_name("layers.0.mlp.gate_up_proj.weight", DS) == [
        "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"]
    assert hf_name("layers.2.self_attn.kv_a_proj_with_mqa.weight", DS) == ["model.layers.2.self_attn.kv_a_proj_with_mqa.weight"]
    assert hf_name("layers.2.mlp.gate.e_score_correction_bias", DS) == ["model.layers.2.mlp.gate.e_score_correction_bias"]
    assert checkpoint_names("model.layers.2.mlp.experts.gate_up_proj", DS, 2) == [
        [f"model.layers.2.mlp.experts.{i}.{p}_proj.weight" for p in ("gate", "up")] for i in range(2)]


@torch.no_grad()
def test_cache_holds_the_latent_row_transformers_caches(tiny_dirs):
    """After a prefill, our cache's K|V halves of each layer are exactly transformers' (latent, rope key)."""
    from transformers import DynamicCache

    ours, _ = load_model(tiny_dirs[DS], with_tokenizer=False)
    ref = hf_reference(tiny_dirs[DS])
    cfg = ours.config
    ids = torch.randint(0, cfg.vocab_size, (1, 20), generator=torch.Generator().manual_seed(5))
    cache = ContiguousKVCache(cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim, 20)
    ours(ids, torch.arange(20)[None], cache)
    hf_cache = DynamicCache()
    ref(ids, cache=hf_cache, use_cache=True)
    for i, layer in enumerate(hf_cache.layers):
        assert layer.keys.shape == (1, 1, 20, 24) and layer.values.shape == (1, 1, 20, 8)
        k, v = ours.kv_from_reference(layer.keys, layer.values)
        torch.testing.assert_close(cache.k[i], k, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cache.v[i], v, rtol=1e-5, atol=1e-5)
    assert cache.k[0].shape == (1, 1, 20, 16)  # 32 values per token and layer, where per-head K/V would be 144


@pytest.mark.parametrize("overrides", [
    pytest.param({"q_lora_rank": None}, id="no-q-bottleneck"),
    # plain rope in the checkpoint's own order, biases on q_a / kv_a / o, every layer sparse, one expert group
    pytest.param({"rope_interleave": False, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
                  "attention_bias": True, "first_k_dense_replace": 0, "n_group": 1, "topk_group": 1,
                  "norm_topk_prob": False, "routed_scaling_factor": 1.0, "n_shared_experts": 1},
                 id="plain-rope-biases-one-group"),
    # YaRN as DeepSeek-V3 ships it: mscale = mscale_all_dim (cos/sin unscaled, softmax scale mscale^2)
    pytest.param({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                                      "mscale_all_dim": 1.0, "original_max_position_embeddings": 32,
                                      "beta_fast": 32.0, "beta_slow": 1.0}, "first_k_dense_replace": 2},
                 id="v3-yarn-two-dense"),
])
def test_variants_match_reference(tmp_path, overrides):
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt", DS, seed=5, **overrides)
    ours, tok = load_model(ckpt)
    ref = hf_reference(ckpt)
    ids = torch.randint(0, ours.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    abs_err, rel_err = logit_errors(ours, ref, ids)
    assert rel_err <= FP32_REL_TOL, f"max abs {abs_err:.3g}, relative {rel_err:.3g}"
    assert incremental_error(ours, ids[:, :24], prefill=9) < 1e-4
    assert chunked_prefill_error(ours, ids[:, :24], chunk=5) < 1e-4
    prompt = tok.encode("The capital of France is")
    assert our_greedy(ours, prompt, 32) == hf_greedy(ref, prompt, 32)


def test_routing_groups_and_bias_are_read(tiny_dirs):
    model, _ = load_model(tiny_dirs[DS], with_tokenizer=False)
    assert type(model.layers[0].mlp).__name__ == "GatedMLP"  # first_k_dense_replace = 1
    router = model.layers[1].mlp.gate
    x = torch.randn(64, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        weights, experts = router(x)
        torch.testing.assert_close(weights.sum(-1), torch.full((64,), 2.5))  # renormalized, then scaled
        assert ((experts // 2).unique(dim=0).shape[0] > 1) and all(len(set(row)) <= 2 for row in (experts // 2).tolist())
        router.e_score_correction_bias.zero_()
        assert not torch.equal(router(x)[1].sort(-1).values, experts.sort(-1).values)


def test_mtp_layers_in_the_files_are_skipped(tiny_dirs, tmp_path):
    """DeepSeek-V3 files keep their MTP layer as `model.layers.{num_hidden_layers}`: skipped on load, as
    transformers does; a layer beyond the MTP count is still an unused tensor, named."""
    from safetensors.torch import load_file, save_file

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_dirs[DS], ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}))
    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.layers.4.eh_proj.weight"] = torch.zeros(64, 128)
    tensors["model.layers.4.mlp.experts.0.down_proj.weight"] = torch.zeros(64, 32)
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    model, _ = load_model(ckpt, with_tokenizer=False)
    assert getattr(model, "mtp", None) is None and len(model.layers) == 4
    tensors["model.layers.5.enorm.weight"] = torch.zeros(64)
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="does not use: model.layers.5.enorm.weight"):
        load_model(ckpt, with_tokenizer=False)


def test_hub_config_agrees_with_the_simulator():
    """DeepSeek-V3's config (the simulator's preset) builds on the meta device with the simulator's
    parameter count (671B without MTP), and our cache keeps its KV bytes per token (61 x 576 values)."""
    from firstlight.models.loader import model_class
    from firstlight.sim.model import load_model as sim_model
    from firstlight.sim.presets import PRESETS

    cfg = ModelConfig.from_hf(PRESETS["deepseek-v3"])
    assert cfg.moe.sparse_layers.count(False) == 3 and cfg.mla.cache_width == 576
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    ours = sum(p.numel() for p in model.parameters())
    sim = sim_model("deepseek-v3")
    assert ours / 1e9 == pytest.approx(671, abs=1)
    assert ours == pytest.approx(sim.num_params(), rel=1e-3)
    cache_bytes = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2  # K and V halves, bf16
    assert cache_bytes == sim.kv_bytes_per_token() == 61 * 576 * 2


def test_mtp_speculation_on_deepseek_v3_is_a_clear_error(tiny_dirs):
    from firstlight.engine.speculative.mtp import check_has_mtp
    from firstlight.errors import FirstlightError

    model, _ = load_model(tiny_dirs[DS], with_tokenizer=False)
    with pytest.raises(FirstlightError, match="does not run DeepSeek-V3's MTP layer yet"):
        check_has_mtp(model)
