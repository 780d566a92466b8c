"""Qwen3.5-MoE: the config read from the hub's vision-language wrapper and from a text-only checkpoint,
both file layouts of the experts, bad configs named, the MTP layer, and MTP speculation in the engine.
Logit / greedy / incremental / chunked-prefill parity with transformers is in test_parity.py (every
family of tiny.py); the engine's staggered greedy in tests/engine/test_engine_families.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from firstlight.errors import ModelLoadError
from firstlight.models.config import FULL, LINEAR, ModelConfig
from firstlight.models.loader import load_model
from tests.models.test_qwen3_next import check_mtp_against_transformers_modules

FAMILY = "qwen3_5_moe"


def _logits(ckpt: Path) -> torch.Tensor:
    model, _ = load_model(ckpt, with_tokenizer=False)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(ids)


def _rewrite(src: Path, dst: Path, config: dict | None = None, tensors=None) -> Path:
    """A copy of checkpoint `src` with its config and/or tensors replaced."""
    shutil.copytree(src, dst)
    if config is not None:
        (dst / "config.json").write_text(json.dumps(config))
    if tensors is not None:
        save_file(tensors, dst / "model.safetensors")
    return dst


def _stacked(tensors: dict[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """The hub layout: each layer's experts stacked as transformers keeps them in memory,
    `mlp.experts.gate_up_proj` [X, 2I, E] and `mlp.experts.down_proj` [X, E, I]."""
    out = {n: t for n, t in tensors.items() if ".mlp.experts." not in n}
    heads = {n.split(".mlp.experts.")[0] for n in tensors if ".mlp.experts." in n}
    for head in heads:
        def part(i: int, proj: str, h: str = head) -> torch.Tensor:
            return tensors[f"{h}.mlp.experts.{i}.{proj}.weight"]
        out[f"{head}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([part(i, "gate_proj"), part(i, "up_proj")]) for i in range(num_experts)])
        out[f"{head}.mlp.experts.down_proj"] = torch.stack([part(i, "down_proj") for i in range(num_experts)])
    return out


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint) -> Path:
    return tiny_checkpoint(FAMILY, seed=1)  # tiny_dirs' checkpoint, without building every family


@pytest.fixture(scope="module")
def wrapper(ckpt) -> dict:
    return json.loads((ckpt / "config.json").read_text())


def test_the_tiny_checkpoint_is_laid_out_as_the_hub_ships_it(ckpt, wrapper):
    """A vision-language wrapper: text config nested, text model under model.language_model., a vision
    tower beside it, the LM head and MTP layer at the top."""
    assert wrapper["model_type"] == FAMILY and wrapper["text_config"]["model_type"] == "qwen3_5_moe_text"
    assert wrapper["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    prefixes = {".".join(n.split(".")[:2]) for n in load_file(ckpt / "model.safetensors")}
    assert prefixes == {"model.language_model", "model.visual", "lm_head.weight", "mtp.fc", "mtp.layers",
                        "mtp.norm", "mtp.pre_fc_norm_embedding", "mtp.pre_fc_norm_hidden"}


def test_layer_pattern_and_derived_fields(wrapper):
    cfg = ModelConfig.from_hf(wrapper)
    assert cfg.model_type == FAMILY and cfg.family == "qwen3_5_moe:Qwen3_5Moe"
    assert cfg.layer_types == (LINEAR, LINEAR, LINEAR, FULL) and cfg.kv_layers == (3,)
    assert cfg.rope[FULL].rotary_dim(cfg.head_dim) == cfg.head_dim // 2  # mrope on text: partial 1-D rope
    assert cfg.attn_output_gate and cfg.qk_norm and cfg.num_mtp_layers == 1 and cfg.mtp_field == "mtp_num_hidden_layers"
    assert not cfg.linear_attn.grouped_in_proj
    assert cfg.moe.sparse_layers == (True,) * 4 and cfg.moe.norm_topk_prob
    assert cfg.moe.shared_expert_intermediate_size == 48
    # the text config alone (a text-only checkpoint) is the same model
    text = ModelConfig.from_hf(wrapper["text_config"])
    assert (text.model_type, text.layer_types, text.moe, text.linear_attn) == (
        FAMILY, cfg.layer_types, cfg.moe, cfg.linear_attn)
    # without layer_types: transformers' default, full attention every 4th layer, partial_rotary_factor 0.25
    bare = {k: v for k, v in wrapper["text_config"].items() if k not in ("layer_types", "rope_parameters")}
    classic = ModelConfig.from_hf(bare | {"num_hidden_layers": 8})
    assert classic.layer_types == (LINEAR, LINEAR, LINEAR, FULL) * 2
    assert classic.rope[FULL].rotary_dim(classic.head_dim) == classic.head_dim // 4


def test_generation_config_eos_reaches_the_text_model(ckpt):
    from firstlight.models.loader import load_config

    assert load_config(ckpt).eos_token_ids == (2, 4)  # the wrapper's text_config says 2; generation_config 2, 4


def test_vision_tower_is_not_read_and_a_text_only_checkpoint_loads_the_same(ckpt, wrapper, tmp_path):
    files = load_file(ckpt / "model.safetensors")
    text_only = {n.replace("model.language_model.", "model."): t for n, t in files.items()
                 if not n.startswith("model.visual.")}
    config = {**wrapper["text_config"], "architectures": ["Qwen3_5MoeForCausalLM"]}
    plain = _rewrite(ckpt, tmp_path / "text", config, text_only)
    torch.testing.assert_close(_logits(plain), _logits(ckpt), rtol=0, atol=0)


def test_stacked_experts_as_on_the_hub_load_the_same(ckpt, wrapper, tmp_path):
    files = load_file(ckpt / "model.safetensors")
    stacked = _rewrite(ckpt, tmp_path / "stacked", tensors=_stacked(files, wrapper["text_config"]["num_experts"]))
    torch.testing.assert_close(_logits(stacked), _logits(ckpt), rtol=0, atol=0)


@pytest.mark.parametrize("layout", ["per-expert", "stacked"])
def test_expert_count_mismatch_names_the_field(ckpt, wrapper, tmp_path, layout):
    files = load_file(ckpt / "model.safetensors")
    tensors = _stacked(files, 4) if layout == "stacked" else None
    config = json.loads(json.dumps(wrapper))
    config["text_config"]["num_experts"] = 3
    bad = _rewrite(ckpt, tmp_path / "bad", config, tensors)
    with pytest.raises(ModelLoadError, match=r"field 'num_experts' is 3 but the checkpoint has 4 experts in layer 0"):
        load_model(bad, with_tokenizer=False)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("layer_types", ["linear_attention", "mamba", "linear_attention", "full_attention"],
     r"config field 'layer_types' has unknown layer type\(s\) \['mamba'\] for qwen3_5_moe"),
    ("layer_types", ["sliding_attention"] * 4, r"'layer_types' has unknown layer type\(s\) \['sliding_attention'\]"),
    ("num_experts_per_tok", 5, r"'num_experts_per_tok' \(5\) must lie in \[1, num_experts=4\]"),
    ("linear_num_value_heads", 3, r"'linear_num_value_heads' \(3\) must be a multiple of 'linear_num_key_heads'"),
    ("mtp_num_hidden_layers", -1, r"mtp_num_hidden_layers = -1 is not a plausible count"),
])
def test_bad_text_config_names_the_field(wrapper, field, value, message):
    config = json.loads(json.dumps(wrapper))
    config["text_config"][field] = value
    with pytest.raises(ModelLoadError, match=message):
        ModelConfig.from_hf(config)


def test_mtp_layer_count_is_read_from_the_files_when_the_config_omits_it(ckpt, wrapper, tmp_path):
    config = json.loads(json.dumps(wrapper))
    del config["text_config"]["mtp_num_hidden_layers"]
    model, _ = load_model(_rewrite(ckpt, tmp_path / "ckpt", config), with_tokenizer=False)
    assert model.config.num_mtp_layers == 1 and model.mtp is not None


def test_mtp_matches_a_reimplementation_from_transformers_modules(ckpt):
    check_mtp_against_transformers_modules(ckpt, FAMILY)


def test_mtp_speculation_keeps_greedy_output(tiny_checkpoint):
    """`--speculative mtp` with the checkpoint's MTP layer: 6 staggered prompts, chunked prefill next to
    verify passes, k = 3; tokens identical to the engine without speculation."""
    from firstlight.engine.speculative.config import SpecConfig
    from tests.engine.test_engine import prompts, run_staggered
    from tests.speculative.test_mtp import GREEDY, _engine, _tokens

    model, tok = load_model(tiny_checkpoint(FAMILY, seed=2))
    plain = _tokens(run_staggered(_engine(model, tok, None), prompts(6, seed=4), GREEDY))
    engine = _engine(model, tok, SpecConfig("mtp", num_spec_tokens=3))
    assert _tokens(run_staggered(engine, prompts(6, seed=4), GREEDY)) == plain
    assert engine.spec.stats.num_drafts > 20
    assert engine.kv.num_used_blocks == 0 and engine.kv.num_free_slots == engine.kv.num_slots


def test_mtp_without_an_mtp_layer_names_the_field(tmp_path):
    from firstlight.engine.speculative.mtp import check_has_mtp
    from firstlight.errors import FirstlightError
    from firstlight.models.tiny import write_tiny_checkpoint

    model, _ = load_model(write_tiny_checkpoint(tmp_path / "no-mtp", FAMILY, seed=1, mtp_num_hidden_layers=0),
                          with_tokenizer=False)
    assert model.mtp is None
    with pytest.raises(FirstlightError, match=r"mtp_num_hidden_layers = 0 and no mtp\.\* weights were loaded"):
        check_has_mtp(model)
