"""Granite 4.0-H pieces: the chunked SSD scan against its recurrence, the layer pattern in both
spellings, bad layer types named, the checkpoint's renamed tensors, and the variants the default tiny
checkpoint does not take (rope, no experts)."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from firstlight.errors import ModelLoadError
from firstlight.models.config import FULL, MAMBA, ModelConfig
from firstlight.models.hf_names import checkpoint_names, hf_module_name, hf_name
from firstlight.models.loader import load_model
from firstlight.models.mamba2 import ssd_chunked, ssd_recurrent
from firstlight.models.tiny import tiny_config, write_tiny_checkpoint
from tests.models.parity import FP32_REL_TOL, hf_reference, incremental_error, logit_errors


def _inputs(seq: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    b, h, p, n = 2, 3, 5, 4
    x = torch.randn(b, h, seq, p, generator=g)
    dt = torch.nn.functional.softplus(torch.randn(b, h, seq, generator=g))
    a = -torch.rand(h, generator=g) * 2 - 0.1
    bb, cc = torch.randn(b, h, seq, n, generator=g), torch.randn(b, h, seq, n, generator=g)
    state = torch.randn(b, h, p, n, generator=g)
    return x, dt, a, bb, cc, state


@pytest.mark.parametrize(("seq", "chunk"), [(1, 4), (7, 4), (8, 4), (21, 8), (5, 64)])
def test_chunked_scan_equals_the_recurrence(seq, chunk):
    """Chunk-parallel prefill (with padding of the last chunk) == token by token, outputs and state."""
    x, dt, a, b, c, state = _inputs(seq)
    out_c, state_c = ssd_chunked(x, dt, a, b, c, state, chunk=chunk)
    out_r, state_r = ssd_recurrent(x, dt, a, b, c, state)
    assert torch.allclose(out_c, out_r, atol=1e-5)
    assert torch.allclose(state_c, state_r, atol=1e-5)


def test_recurrence_decays_then_writes():
    """One step by hand: S' = exp(dt A) S + dt x B^T and y = S' C."""
    x, dt, a, b, c, state = _inputs(1)
    out, new = ssd_recurrent(x, dt, a, b, c, state)
    h = 1
    want = math.exp(dt[0, h, 0].item() * a[h].item()) * state[0, h] + dt[0, h, 0] * torch.outer(x[0, h, 0], b[0, h, 0])
    assert torch.allclose(new[0, h], want, atol=1e-6)
    assert torch.allclose(out[0, h, 0], want @ c[0, h, 0], atol=1e-5)


def _cfg(**overrides) -> ModelConfig:
    return ModelConfig.from_hf(tiny_config("granitemoehybrid", **overrides))


def test_layer_pattern_in_both_spellings_and_derived_fields():
    hub = _cfg()  # Granite 4.0-H's config.json spells the layers mamba / attention
    assert hub.layer_types == (MAMBA, MAMBA, FULL, MAMBA)
    assert hub.kv_layers == (2,) and hub.state_layers == (0, 1, 3)
    saved = _cfg(layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"])
    assert saved.layer_types == hub.layer_types  # transformers 5 writes them back renamed
    legacy = _cfg(layer_types=None, layers_block_type=["attention", "mamba", "mamba", "mamba"])
    assert legacy.layer_types == (FULL, MAMBA, MAMBA, MAMBA)
    m = hub.mamba
    assert (m.num_heads, m.head_dim, m.num_groups, m.state_size) == (8, 16, 2, 16)
    assert m.intermediate_size == 128 and m.conv_dim == 128 + 2 * 2 * 16
    assert hub.intermediate_size == 48 and hub.moe.intermediate_size == 32  # shared MLP vs each expert
    assert not hub.use_rope and hub.attn_scale == 0.2 and hub.logits_scaling == 2.0
    assert _cfg(num_local_experts=0).moe is None
    assert _cfg(mamba_d_head="auto").mamba.head_dim == 2 * 64 // 8
    # transformers' JSON for an infinite bound
    assert _cfg(time_step_limit=[0.0, {"__float__": "Infinity"}]).mamba.time_step_max == math.inf


@pytest.mark.parametrize(("overrides", "words"), [
    ({"layer_types": ["mamba", "mamba", "moe", "mamba"]}, r"config field 'layer_types' has unknown layer type\(s\) \['moe'\]"),
    ({"layer_types": None, "layers_block_type": ["mamba", "ssm", "attention", "mamba"]},
     r"config field 'layers_block_type' has unknown layer type\(s\) \['ssm'\]"),
    ({"layer_types": ["mamba", "attention"]}, "config field 'layer_types' must list 4 layers, got 2"),
    ({"mamba_n_groups": 3}, "'mamba_n_heads' \\(8\\) must be a multiple of 'mamba_n_groups' \\(3\\)"),
    ({"mamba_d_head": 32}, "mamba_n_heads \\(8\\) x mamba_d_head \\(32\\) must equal"),
    ({"mamba_d_state": 10**6}, "mamba_d_state = 1000000 is not a plausible size"),
    ({"time_step_limit": [0.0, "fast"]}, "time_step_limit"),
])
def test_bad_config_is_named(overrides, words):
    with pytest.raises(ModelLoadError, match=words):
        _cfg(**overrides)


def test_unknown_layer_type_in_a_checkpoint_fails_naming_the_field(tiny_dirs, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_dirs["granitemoehybrid"], ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["layer_types"][1] = "mamba3"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"config\.json: .*'layer_types' has unknown layer type\(s\) \['mamba3'\]"):
        load_model(ckpt, with_tokenizer=False)


def test_checkpoint_names():
    """Ours → transformers' in-memory names → the file names transformers writes (and the hub ships)."""
    assert hf_name("layers.0.shared_mlp.gate_up_proj.weight") == ["model.layers.0.shared_mlp.input_linear.weight"]
    assert hf_name("layers.0.shared_mlp.down_proj.weight") == ["model.layers.0.shared_mlp.output_linear.weight"]
    assert hf_module_name("layers.0.shared_mlp.gate_up_proj") == "model.layers.0.shared_mlp.input_linear"
    assert hf_module_name("layers.0.mlp.gate_up_proj") == "model.layers.0.mlp.gate_proj"
    assert checkpoint_names("model.layers.3.block_sparse_moe.experts.gate_up_proj", "granitemoehybrid", 4) == [
        "model.layers.3.block_sparse_moe.input_linear.weight"]
    assert checkpoint_names("model.layers.3.block_sparse_moe.router.weight", "granitemoehybrid", 4) == [
        "model.layers.3.block_sparse_moe.router.layer.weight"]
    assert hf_name("layers.1.mamba.A_log") == ["model.layers.1.mamba.A_log"]


@pytest.mark.parametrize("overrides", [
    pytest.param({"position_embedding_type": "rope"}, id="rope"),
    pytest.param({"num_local_experts": 0, "layer_types": ["attention", "mamba", "mamba", "attention"],
                  "mamba_n_groups": 1}, id="dense-one-group"),
])
def test_variants_match_reference(tmp_path, overrides):
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt", "granitemoehybrid", seed=5, **overrides)
    ours, _ = load_model(ckpt, with_tokenizer=False)
    ref = hf_reference(ckpt)
    ids = torch.randint(0, ours.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    abs_err, rel_err = logit_errors(ours, ref, ids)
    assert rel_err <= FP32_REL_TOL, f"max abs {abs_err:.3g}, relative {rel_err:.3g}"
    assert incremental_error(ours, ids, prefill=9) < 1e-4


def test_rope_changes_the_output(tiny_dirs, tmp_path):
    """The NoPE flag is read, not ignored: the same weights with rope on give other logits."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_dirs["granitemoehybrid"], ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "position_embedding_type": "rope"}))
    nope, _ = load_model(tiny_dirs["granitemoehybrid"], with_tokenizer=False)
    rope, _ = load_model(ckpt, with_tokenizer=False)
    ids = torch.randint(0, 384, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (nope(ids) - rope(ids)).abs().max() > 1e-3


def test_a_hub_shaped_config_builds_with_its_state_sizes():
    """A config shaped like granite-4.0-h-tiny's (40 layers, 4 attention, 64 experts, NoPE) parses and
    builds (on the meta device), with Mamba state per request as its sizes say."""
    from firstlight.engine.runner import ModelRunner
    from firstlight.models.loader import model_class

    attention = {5, 15, 25, 35}
    hub = {
        "model_type": "granitemoehybrid", "vocab_size": 100352, "hidden_size": 1536, "intermediate_size": 512,
        "shared_intermediate_size": 1024, "num_hidden_layers": 40, "num_attention_heads": 12,
        "num_key_value_heads": 4, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "layer_types": ["attention" if i in attention else "mamba" for i in range(40)],
        "position_embedding_type": "nope", "num_local_experts": 64, "num_experts_per_tok": 6,
        "mamba_n_heads": 48, "mamba_n_groups": 1, "mamba_d_state": 128, "mamba_d_head": 64, "mamba_d_conv": 4,
        "mamba_expand": 2, "mamba_chunk_size": 256, "mamba_conv_bias": True, "mamba_proj_bias": False,
        "embedding_multiplier": 12, "logits_scaling": 6, "residual_multiplier": 0.22,
        "attention_multiplier": 0.0078125, "tie_word_embeddings": True, "rope_theta": 10000,
    }
    cfg = ModelConfig.from_hf(hub)
    assert cfg.kv_layers == tuple(sorted(attention)) and len(cfg.state_layers) == 36
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    mixer = model.layers[0].mamba
    assert mixer.in_proj.weight.shape == (2 * 3072 + 2 * 128 + 48, 1536)  # z, x|B|C, dt
    assert model.layers[5].block_sparse_moe.experts.gate_up_proj.shape == (64, 1024, 1536)
    per_layer = 4 * ((3072 + 2 * 128) * 3 + 48 * 64 * 128)  # fp32 model: conv + SSM state
    assert ModelRunner.state_bytes_per_slot(model) == 36 * per_layer
