"""Nemotron-H: the layer pattern in its spellings and its bad inputs named, the checkpoint's names, the
pieces that differ from Granite 4.0-H (relu2, DeepSeek-V3 routing, the dt clamp, the latent MoE width),
against transformers. Logit parity, greedy, incremental and chunked prefill of the default tiny
checkpoint run in test_parity.py with every family."""

from __future__ import annotations

import importlib.metadata
import json
import math
import shutil

import pytest
import torch

from firstlight.errors import ModelLoadError
from firstlight.models.config import FULL, MAMBA, MLP, MOE, ModelConfig
from firstlight.models.hf_names import checkpoint_names, hf_module_name, hf_name
from firstlight.models.loader import load_model
from firstlight.models.tiny import tiny_config, write_tiny_checkpoint
from tests.models.parity import FP32_REL_TOL, hf_reference, incremental_error, logit_errors

# transformers clamps Nemotron-H's dt to time_step_limit from 5.25 on (at time_step_min before, in prefill only)
NEEDS_DT_LIMIT = pytest.mark.skipif(
    tuple(int(p) for p in importlib.metadata.version("transformers").split(".")[:2]) < (5, 25),
    reason="transformers < 5.25 clamps Nemotron-H's dt at time_step_min, not time_step_limit")

PATTERN = (MAMBA, MLP, MAMBA, FULL, MLP, MOE, MAMBA)  # the tiny's "M-M*-EM"


def _cfg(**overrides) -> ModelConfig:
    return ModelConfig.from_hf(tiny_config("nemotron_h", **overrides))


def test_layer_pattern_in_its_spellings_and_derived_fields():
    hub = _cfg()
    assert hub.layer_types == PATTERN
    assert hub.kv_layers == (3,) and hub.state_layers == (0, 2, 6)  # MLP and MoE blocks keep no cache
    words = ["linear_attention", "mlp", "linear_attention", "full_attention", "mlp", "moe", "linear_attention"]
    # what transformers 5 writes back: a list, and no num_hidden_layers
    saved = _cfg(hybrid_override_pattern=None, num_hidden_layers=None, layers_block_type=words)
    assert saved.layer_types == PATTERN and saved.num_layers == 7
    m = hub.mamba
    assert (m.num_heads, m.head_dim, m.num_groups, m.state_size, m.conv_kernel) == (8, 16, 2, 16, 4)
    assert m.proj_bias and m.conv_bias and m.activation == "silu"
    # dt's clamp is time_step_limit (none by default); time_step_min only sets the dt bias's initial range
    assert (m.time_step_min, m.time_step_max) == (0.0, math.inf)
    assert (_cfg(time_step_limit=[1e-3, 0.1]).mamba.time_step_min, _cfg(mamba_dt_limit=[0.0, 0.5]).mamba.time_step_max) \
        == (1e-3, 0.5)
    assert hub.hidden_act == "relu2" and not hub.use_rope and not hub.tie_word_embeddings
    assert not hub.qkv_bias and not _cfg(attention_bias=True).o_bias  # transformers builds them without bias
    moe = hub.moe
    assert moe.sparse_layers == tuple(t == MOE for t in PATTERN) and not moe.gated_experts
    assert (moe.sigmoid_routing, moe.num_groups, moe.topk_groups, moe.routed_scaling_factor) == (True, 2, 1, 2.5)
    assert _cfg(hybrid_override_pattern="M-M*-MM").moe is None


@pytest.mark.parametrize(("overrides", "words"), [
    ({"hybrid_override_pattern": "M-M*XEM"},
     r"config field 'hybrid_override_pattern' has unknown layer kind\(s\) \['X'\] for nemotron_h; allowed: M \(Mamba-2\)"),
    ({"hybrid_override_pattern": "M-M*E"},
     "config field 'hybrid_override_pattern' lists 5 layers but num_hidden_layers is 7; they must agree"),
    ({"hybrid_override_pattern": None, "layers_block_type": ["linear_attention", "ssm"], "num_hidden_layers": 2},
     r"config field 'layers_block_type' has unknown layer kind\(s\) \['ssm'\]"),
    ({"hybrid_override_pattern": ["M", "-"]}, "config field 'hybrid_override_pattern' must be a string"),
    ({"hybrid_override_pattern": None}, "nemotron_h needs config field 'hybrid_override_pattern'"),
    ({"n_groups": 3}, r"'mamba_num_heads' \(8\) must be a multiple of 'n_groups' \(3\)"),
    ({"ssm_state_size": 10**6}, "ssm_state_size = 1000000 is not a plausible size"),
    ({"n_group": 3}, r"'n_group' \(3\) and 'topk_group'"),
])
def test_bad_config_is_named(overrides, words):
    with pytest.raises(ModelLoadError, match=words):
        _cfg(**overrides)


def test_bad_pattern_in_a_checkpoint_fails_naming_the_field(tiny_dirs, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_dirs["nemotron_h"], ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    words = cfg.pop("layers_block_type")
    (ckpt / "config.json").write_text(json.dumps({**cfg, "hybrid_override_pattern": "M-M*-EQ",
                                                  "num_hidden_layers": len(words)}))
    with pytest.raises(ModelLoadError, match=r"config\.json: .*'hybrid_override_pattern' has unknown layer kind\(s\) \['Q'\]"):
        load_model(ckpt, with_tokenizer=False)
    (ckpt / "config.json").write_text(json.dumps({**cfg, "hybrid_override_pattern": "M-M*-EM", "num_hidden_layers": 9}))
    with pytest.raises(ModelLoadError, match="lists 7 layers but num_hidden_layers is 9"):
        load_model(ckpt, with_tokenizer=False)


def test_checkpoint_names():
    """Ours → transformers' in-memory names → the file names it writes (`backbone.`, one tensor per expert)."""
    nh = "nemotron_h"
    assert hf_name("embed_tokens.weight", nh) == ["model.embeddings.weight"]
    assert hf_name("norm.weight", nh) == ["model.norm_f.weight"]
    assert hf_name("layers.2.norm.weight", nh) == ["model.layers.2.norm.weight"]  # a layer's norm keeps its name
    assert hf_name("layers.3.mixer.qkv_proj.weight", nh) == [
        f"model.layers.3.mixer.{p}_proj.weight" for p in "qkv"]
    assert hf_module_name("norm", nh) == "model.norm_f" and hf_module_name("norm") == "model.norm"
    assert hf_name("lm_head.weight", nh) == ["lm_head.weight"]
    assert checkpoint_names("model.layers.0.mixer.A_log", nh, 4) == ["backbone.layers.0.mixer.A_log"]
    assert checkpoint_names("model.layers.5.mixer.experts.up_proj", nh, 2) == [
        ["backbone.layers.5.mixer.experts.0.up_proj.weight"], ["backbone.layers.5.mixer.experts.1.up_proj.weight"]]
    assert checkpoint_names("lm_head.weight", nh, 4) == ["lm_head.weight"]


def test_wrong_expert_count_is_named(tiny_dirs, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_dirs["nemotron_h"], ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "n_routed_experts": 8, "n_group": 1}))
    with pytest.raises(ModelLoadError, match="field 'n_routed_experts' is 8 but the checkpoint has 4 experts in layer 5"):
        load_model(ckpt, with_tokenizer=False)


@pytest.mark.parametrize("overrides", [
    # dt clamped to time_step_limit: a clamp that bites in slow heads; time_step_min is no clamp (transformers up to
    # 5.24 clamped there instead, in prefill only: those versions are no reference for either case)
    pytest.param({"time_step_limit": [1e-3, math.inf]}, id="dt-limit-clamp", marks=NEEDS_DT_LIMIT),
    pytest.param({"time_step_min": 1e-3}, id="dt-min-no-clamp", marks=NEEDS_DT_LIMIT),
    # experts in a latent width; routing over all experts in one group, unscaled, not renormalized
    pytest.param({"moe_latent_size": 24, "n_group": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": False,
                  "hybrid_override_pattern": "*EM-", "num_hidden_layers": 4, "n_groups": 1, "use_bias": False},
                 id="latent-moe-one-group"),
])
def test_variants_match_reference(tmp_path, overrides):
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt", "nemotron_h", seed=5, **overrides)
    ours, _ = load_model(ckpt, with_tokenizer=False)
    ref = hf_reference(ckpt)
    ids = torch.randint(0, ours.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    abs_err, rel_err = logit_errors(ours, ref, ids)
    assert rel_err <= FP32_REL_TOL, f"max abs {abs_err:.3g}, relative {rel_err:.3g}"
    assert incremental_error(ours, ids, prefill=9) < 1e-4


def test_dt_clamp_bites_in_the_clamp_variant(tmp_path):
    """The dt-clamp variant above is not vacuous: without the clamp the logits move."""
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt", "nemotron_h", seed=5, time_step_limit=[1e-3, math.inf])
    ours, _ = load_model(ckpt, with_tokenizer=False)
    ids = torch.randint(0, 384, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        clamped = ours(ids)
        for layer in ours.layers:
            if layer.layer_type == MAMBA:
                layer.mixer.dt_min = 0.0
        assert (ours(ids) - clamped).abs().max() > 1e-3


def test_routing_bias_and_groups_are_read(tiny_dirs):
    """The correction bias and the expert groups change which experts a token gets."""
    model, _ = load_model(tiny_dirs["nemotron_h"], with_tokenizer=False)
    router = model.layers[5].mixer.gate
    x = torch.randn(64, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        weights, experts = router(x)
        assert weights.dtype == torch.float32
        torch.testing.assert_close(weights.sum(-1), torch.full((64,), 2.5))  # renormalized, then scaled
        group = experts // 2  # 2 groups of 2 experts, top-1 group: both picks in one group
        assert torch.equal(group[:, 0], group[:, 1])
        router.e_score_correction_bias.zero_()
        assert not torch.equal(router(x)[1].sort(-1).values, experts.sort(-1).values)


def test_a_hub_shaped_config_builds_with_its_state_sizes():
    """A config shaped like Nemotron-H-8B-Base's (52 layers, 4 attention, NoPE) parses and builds on the
    meta device, with Mamba-2 state for its 24 Mamba layers and K/V for its 4 attention layers only."""
    from firstlight.engine.runner import ModelRunner
    from firstlight.models.loader import model_class

    pattern = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
    hub = {
        "model_type": "nemotron_h", "vocab_size": 131072, "hidden_size": 4096, "intermediate_size": 21504,
        "num_hidden_layers": 52, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "hybrid_override_pattern": pattern, "mamba_num_heads": 128, "mamba_head_dim": 64, "n_groups": 8,
        "ssm_state_size": 128, "conv_kernel": 4, "expand": 2, "chunk_size": 128, "use_conv_bias": True,
        "use_bias": False, "mlp_hidden_act": "relu2", "layer_norm_epsilon": 1e-5, "tie_word_embeddings": False,
        "max_position_embeddings": 8192,
    }
    cfg = ModelConfig.from_hf(hub)
    assert len(cfg.kv_layers) == 4 and len(cfg.state_layers) == 24 and cfg.moe is None
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    assert model.layers[0].mixer.in_proj.weight.shape == (2 * 8192 + 2 * 8 * 128 + 128, 4096)  # z, x|B|C, dt
    assert model.layers[1].mixer.up_proj.weight.shape == (21504, 4096)
    per_layer = 4 * ((8192 + 2 * 8 * 128) * 3 + 128 * 64 * 128)  # fp32 model: conv + SSM state
    assert ModelRunner.state_bytes_per_slot(model) == 24 * per_layer
