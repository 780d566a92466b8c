"""Loading checkpoints: formats, dtypes, and every kind of bad input gets a clear error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from firstlight.errors import ModelLoadError, UnknownModelError
from firstlight.models.config import FULL, SLIDING, ModelConfig
from firstlight.models.loader import load_config, load_model


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def test_sharded_checkpoint_loads_like_single_file(tiny_dirs, tmp_path):
    ckpt = _copy(tiny_dirs["qwen3"], tmp_path)
    tensors = load_file(ckpt / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for fname, part in shards.items():
        save_file({n: tensors[n] for n in part}, ckpt / fname, metadata={"format": "pt"})
    weight_map = {n: f for f, part in shards.items() for n in part}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (ckpt / "model.safetensors").unlink()
    a, _ = load_model(tiny_dirs["qwen3"], with_tokenizer=False)
    b, _ = load_model(ckpt, with_tokenizer=False)
    ids = torch.arange(10).unsqueeze(0)
    assert torch.equal(a(ids), b(ids))


def test_dtype_selection(tiny_dirs):
    model, _ = load_model(tiny_dirs["llama"], dtype="bfloat16", with_tokenizer=False)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    with pytest.raises(ModelLoadError, match="dtype 'int3'"):
        load_model(tiny_dirs["llama"], dtype="int3")


def test_missing_dir(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_missing_config(tiny_dirs, tmp_path):
    ckpt = _copy(tiny_dirs["llama"], tmp_path)
    (ckpt / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"config.json not found"):
        load_model(ckpt)


def test_missing_weights(tiny_dirs, tmp_path):
    ckpt = _copy(tiny_dirs["llama"], tmp_path)
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no model.safetensors"):
        load_model(ckpt)


def test_truncated_safetensors(tiny_dirs, tmp_path):
    ckpt = _copy(tiny_dirs["llama"], tmp_path)
    f = ckpt / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="truncated"):
        load_model(ckpt)


def test_corrupt_safetensors_header(tiny_dirs, tmp_path):
    ckpt = _copy(tiny_dirs["llama"], tmp_path)
    (ckpt / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_model(ckpt)


def test_unknown_model_type_lists_supported(tiny_dirs, tmp_path):
    ckpt = _copy(tiny_dirs["llama"], tmp_path)
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "model_type": "falcon"}))
    with pytest.raises(UnknownModelError, match="'falcon' is not supported; supported: deepseek_v3, gemma3_text, granitemoehybrid, llama"):
        load_model(ckpt)


def test_shape_mismatch_names_tensor_and_shapes(tiny_dirs, tmp_path):
    ckpt = _copy(tiny_dirs["llama"], tmp_path)
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 96}))
    with pytest.raises(ModelLoadError, match=r"layers.0.mlp.gate_up_proj.weight has shape \[256, 64\].*implies \[192, 64\]"):
        load_model(ckpt)


def test_missing_tensor_is_named(tiny_dirs, tmp_path):
    ckpt = _copy(tiny_dirs["llama"], tmp_path)
    tensors = load_file(ckpt / "model.safetensors")
    del tensors["model.layers.1.post_attention_layernorm.weight"]
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"model.layers.1.post_attention_layernorm.weight is missing"):
        load_model(ckpt)


def test_invalid_json(tiny_dirs, tmp_path):
    ckpt = _copy(tiny_dirs["llama"], tmp_path)
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load_config(ckpt)


def test_classic_llama3_config_layout():
    """Checkpoints on the hub keep rope_theta/rope_scaling flat; both layouts parse the same."""
    base = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100}
    classic = ModelConfig.from_hf({**base, "rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}})
    new = ModelConfig.from_hf({**base, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})
    assert classic.rope == new.rope
    assert classic.rope[FULL].kind == "llama3" and classic.head_dim == 16


def test_classic_gemma3_config_layout():
    cfg = ModelConfig.from_hf({"model_type": "gemma3_text", "hidden_size": 64, "intermediate_size": 128,
                               "num_hidden_layers": 12, "num_attention_heads": 4, "num_key_value_heads": 1,
                               "head_dim": 32, "vocab_size": 100, "rope_theta": 1e6,
                               "rope_local_base_freq": 1e4, "sliding_window": 512,
                               "sliding_window_pattern": 6, "query_pre_attn_scalar": 32})
    assert cfg.layer_types[5] == FULL and cfg.layer_types[11] == FULL and cfg.layer_types[0] == SLIDING
    assert cfg.rope[FULL].theta == 1e6 and cfg.rope[SLIDING].theta == 1e4
    assert cfg.window(0) == 512 and cfg.window(5) is None
    assert cfg.attn_scale == pytest.approx(32**-0.5)


def test_unsupported_rope_type():
    with pytest.raises(ModelLoadError, match="rope_type 'longrope' is not supported"):
        ModelConfig.from_hf({"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128,
                             "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100,
                             "rope_scaling": {"rope_type": "longrope", "factor": 4.0}})


def test_missing_required_field():
    with pytest.raises(ModelLoadError, match="missing required field 'hidden_size'"):
        ModelConfig.from_hf({"model_type": "llama", "vocab_size": 10})
