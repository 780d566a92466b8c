"""Sparse MoE pieces: the router as each family computes it, grouped expert dispatch, bad configs."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from firstlight.errors import ModelLoadError
from firstlight.models.config import ModelConfig
from firstlight.models.loader import load_model
from firstlight.models.moe import Experts, Router

MOE = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
       "num_key_value_heads": 2, "vocab_size": 100}


def _cfg(model_type: str, **extra) -> ModelConfig:
    fields = {"num_experts": 6, "num_experts_per_tok": 3, "moe_intermediate_size": 16,
              "shared_expert_intermediate_size": 24}
    if model_type == "mixtral":
        fields = {"num_local_experts": 6, "num_experts_per_tok": 3}
    return ModelConfig.from_hf({"model_type": model_type, **MOE, **fields, **extra})


@pytest.mark.parametrize(("model_type", "hf_module", "hf_class", "norm"), [
    ("mixtral", "mixtral", "MixtralTopKRouter", None),
    ("qwen2_moe", "qwen2_moe", "Qwen2MoeTopKRouter", False),
    ("qwen3_moe", "qwen3_moe", "Qwen3MoeTopKRouter", True),
])
def test_router_matches_the_family_reference(model_type, hf_module, hf_class, norm):
    import importlib

    from transformers import AutoConfig

    extra = {} if norm is None else {"norm_topk_prob": norm}
    cfg = _cfg(model_type, **extra)
    hf_cfg = AutoConfig.for_model(**{k: v for k, v in cfg.hf.items() if k != "model_type"}, model_type=model_type)
    ref = getattr(importlib.import_module(f"transformers.models.{hf_module}.modeling_{hf_module}"), hf_class)(hf_cfg)
    ours = Router(cfg)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(ours.weight.shape, generator=torch.Generator().manual_seed(0)))
        ref.weight.copy_(ours.weight)
    x = torch.randn(50, 32, generator=torch.Generator().manual_seed(1))
    w, e = ours(x)
    _, ref_w, ref_e = ref(x)
    assert torch.equal(e, ref_e)
    assert torch.allclose(w, ref_w, atol=1e-7)
    sums = w.sum(-1)
    renormalized = bool(torch.allclose(sums, torch.ones_like(sums)))
    assert renormalized == (norm is None or norm)  # Mixtral always renormalizes; Qwen per norm_topk_prob


def test_grouped_dispatch_equals_a_per_token_loop():
    """Grouped by expert (with experts that get no token) gives what each token's own k experts give."""
    cfg = _cfg("qwen3_moe")
    experts = Experts(cfg)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=g) / 6)
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=g) / 4)
    x = torch.randn(9, 32, generator=g)
    ids = torch.randint(0, 4, (9, 3), generator=g)  # experts 4 and 5 never picked
    weights = torch.rand(9, 3, generator=g)
    out = experts(x, weights, ids)
    ref = torch.zeros_like(x)
    for t in range(9):
        for j in range(3):
            e = int(ids[t, j])
            gate, up = (experts.gate_up_proj[e] @ x[t]).split(16)
            ref[t] += weights[t, j] * (experts.down_proj[e] @ (torch.nn.functional.silu(gate) * up))
    assert torch.allclose(out, ref, atol=1e-5)


def test_moe_layer_pattern_follows_sparse_step_and_dense_layers():
    cfg = _cfg("qwen2_moe", num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])
    assert cfg.moe.sparse_layers == (False, True, False, False, False, True)


def test_too_many_experts_per_token_names_the_field():
    with pytest.raises(ModelLoadError, match=r"'num_experts_per_tok' \(9\) must lie in \[1, num_local_experts=6\]"):
        _cfg("mixtral", num_experts_per_tok=9)


@pytest.mark.parametrize(("family", "field"), [("mixtral", "num_local_experts"), ("qwen2_moe", "num_experts")])
def test_expert_count_mismatch_names_the_field(tiny_dirs, tmp_path, family, field):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_dirs[family], ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.pop("num_local_experts", None)
    (ckpt / "config.json").write_text(json.dumps({**cfg, field: 3}))
    with pytest.raises(ModelLoadError, match=rf"field '{field}' is 3 but the checkpoint has 4 experts in layer 0"):
        load_model(ckpt, with_tokenizer=False)


def test_unknown_layer_type_names_the_field():
    with pytest.raises(ModelLoadError, match=r"'layer_types' has unknown layer type\(s\) \['mamba'\]"):
        ModelConfig.from_hf({"model_type": "qwen3_moe", **MOE, "num_experts": 4, "num_experts_per_tok": 2,
                             "moe_intermediate_size": 16, "layer_types": ["full_attention", "mamba"]})


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_bf16_moe_close_to_fp32(tiny_dirs, family):
    ours32, _ = load_model(tiny_dirs[family], with_tokenizer=False)
    ours16, _ = load_model(tiny_dirs[family], dtype="bfloat16", with_tokenizer=False)
    ids = torch.randint(0, ours32.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a, b = ours32(ids), ours16(ids).float()
    assert (a - b).abs().max() / (a.max() - a.min()) < 0.05
