"""Checkpoints that are wrong on purpose or by accident: each is a named one-line error (ModelLoadError),
and on the command line exit 1 with no traceback unless `--debug` is given."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from firstlight.errors import ModelLoadError
from firstlight.models.loader import load_model


@pytest.fixture
def ckpt(tiny_checkpoint, tmp_path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint("llama", seed=0), dst)
    return dst


def _edit_config(ckpt: Path, **changes: object) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.update(changes)
    (ckpt / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("content", ["[1, 2, 3]", '"llama"', "42", "null"])
def test_config_not_a_mapping(ckpt, content) -> None:
    (ckpt / "config.json").write_text(content)
    with pytest.raises(ModelLoadError, match=r"config.json.*JSON object"):
        load_model(ckpt, with_tokenizer=False)


@pytest.mark.parametrize("field,value,words", [
    ("max_position_embeddings", 0, "max_position_embeddings"),
    ("vocab_size", 10**12, "vocab_size"),
    ("hidden_size", -64, "hidden_size"),
    ("num_hidden_layers", 0, "num_hidden_layers"),
    ("num_attention_heads", 0, "num_attention_heads"),
    ("intermediate_size", 2**40, "intermediate_size"),
    ("vocab_size", "many", "vocab_size"),
])
def test_zero_or_absurd_sizes(ckpt, field, value, words) -> None:
    _edit_config(ckpt, **{field: value})
    with pytest.raises(ModelLoadError, match=words):
        load_model(ckpt, with_tokenizer=False)


def _shard(ckpt: Path, target: str) -> None:
    names = json.loads((ckpt / "model.safetensors").read_bytes()[8:8 + int.from_bytes(
        (ckpt / "model.safetensors").read_bytes()[:8], "little")]).keys()
    weight_map = {n: target for n in names if n != "__metadata__"}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


@pytest.mark.parametrize("target", ["../outside.safetensors", "/etc/passwd", "sub/../../x.safetensors"])
def test_index_pointing_outside_the_checkpoint(ckpt, tmp_path, target) -> None:
    shutil.copy(ckpt / "model.safetensors", tmp_path / "outside.safetensors")  # exists, but not inside
    _shard(ckpt, target)
    with pytest.raises(ModelLoadError, match="outside the checkpoint"):
        load_model(ckpt, with_tokenizer=False)


def test_index_with_non_string_entries(ckpt) -> None:
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": 3}}))
    with pytest.raises(ModelLoadError, match="weight_map"):
        load_model(ckpt, with_tokenizer=False)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "firstlight.cli", *args], capture_output=True, text=True,
                          timeout=120)


def test_cli_one_line_error_and_debug_traceback(ckpt) -> None:
    _edit_config(ckpt, vocab_size=10**12)
    out = _cli("generate", "--model", str(ckpt), "--prompt", "hi", "--max-tokens", "1")
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.strip() and "Warning" not in ln and "W1" not in ln[:3]]
    assert any("vocab_size" in ln and "error" in ln for ln in lines), out.stderr
    out = _cli("--debug", "generate", "--model", str(ckpt), "--prompt", "hi", "--max-tokens", "1")
    assert out.returncode == 1 and "Traceback" in out.stderr and "vocab_size" in out.stderr


def test_cli_unexpected_exception_is_one_line_too() -> None:
    code = ("import sys, firstlight.cli as c\n"
            "@c.app.command('boom')\n"
            "def boom() -> None:\n"
            "    raise RuntimeError('deep inside')\n"
            "sys.argv = ['firstlight', *sys.argv[1:]]\n"
            "c.main()\n")
    out = subprocess.run([sys.executable, "-c", code, "boom"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "RuntimeError: deep inside" in out.stderr and "--debug" in out.stderr
    out = subprocess.run([sys.executable, "-c", code, "--debug", "boom"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "Traceback" in out.stderr


@pytest.mark.parametrize("family,field,value,words", [
    ("mixtral", "num_local_experts", 0, "num_local_experts"),
    ("mixtral", "num_local_experts", 10**6, "num_local_experts"),
    ("mixtral", "num_experts_per_tok", "two", "num_experts_per_tok"),
    ("qwen2_moe", "moe_intermediate_size", 2**40, "moe_intermediate_size"),
    ("qwen2_moe", "shared_expert_intermediate_size", -1, "shared_expert_intermediate_size"),
    ("qwen2_moe", "decoder_sparse_step", 0, "decoder_sparse_step"),
    ("qwen3_next", "linear_num_key_heads", 0, "linear_num_key_heads"),
    ("qwen3_next", "linear_value_head_dim", 10**6, "linear_value_head_dim"),
    ("qwen3_next", "linear_conv_kernel_dim", 0, "linear_conv_kernel_dim"),
    ("qwen3_next", "full_attention_interval", 0, "full_attention_interval"),
    ("qwen3_next", "num_nextn_predict_layers", -3, "num_nextn_predict_layers"),
])
def test_moe_and_hybrid_sizes_are_checked_too(tiny_checkpoint, tmp_path, family, field, value, words) -> None:
    dst = tmp_path / family
    shutil.copytree(tiny_checkpoint(family, seed=0), dst)
    extra = {"layer_types": None} if field == "full_attention_interval" else {}  # the interval, not a list
    _edit_config(dst, **{field: value}, **extra)
    with pytest.raises(ModelLoadError, match=words):
        load_model(dst, with_tokenizer=False)
