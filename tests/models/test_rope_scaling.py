"""YaRN and dynamic-NTK rope scaling: frequencies as transformers' rope init functions compute them,
and whole-model parity on tiny checkpoints that use them."""

from __future__ import annotations

import pytest
import torch

from firstlight.models.config import FULL, ModelConfig
from firstlight.models.layers import dynamic_ntk_inv_freq, rope_inv_freq
from firstlight.models.loader import load_model
from tests.models.parity import FP32_REL_TOL, hf_greedy, hf_reference, logit_errors, our_greedy

BASE = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "max_position_embeddings": 64}

YARN_CASES = [
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16},
    {"rope_type": "yarn", "rope_theta": 1e6, "factor": 8.0, "original_max_position_embeddings": 32,
     "beta_fast": 16, "beta_slow": 2, "truncate": False},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 16,
     "mscale": 1.0, "mscale_all_dim": 0.707},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0, "original_max_position_embeddings": 16,
     "attention_factor": 1.3},
]


def _hf_config(params: dict):
    from transformers import AutoConfig

    cfg = dict(BASE)
    return AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "model_type"},
                                model_type="qwen2", rope_parameters=dict(params))


@pytest.mark.parametrize("params", YARN_CASES)
def test_yarn_frequencies_and_scale_match_transformers(params):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    ref_inv, ref_scale = ROPE_INIT_FUNCTIONS["yarn"](_hf_config(params), "cpu")
    ours = ModelConfig.from_hf({**BASE, "rope_parameters": params}).rope[FULL]
    assert torch.allclose(rope_inv_freq(ours, 16), ref_inv, rtol=1e-6, atol=0)
    assert ours.cos_sin_scale == pytest.approx(ref_scale, rel=1e-9)


@pytest.mark.parametrize("seq_len", [10, 64, 65, 100, 300])
def test_dynamic_ntk_frequencies_match_transformers(seq_len):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}
    ref_inv, _ = ROPE_INIT_FUNCTIONS["dynamic"](_hf_config(params), "cpu", seq_len=seq_len)
    cfg = ModelConfig.from_hf({**BASE, "rope_parameters": params})
    positions = torch.arange(seq_len).unsqueeze(0)
    ours = dynamic_ntk_inv_freq(cfg.rope[FULL], cfg.head_dim, positions)[0, 0]
    assert torch.allclose(ours, ref_inv, rtol=1e-5, atol=0)
    # the context the scaling is made for: max_position_embeddings x factor
    assert cfg.max_position_embeddings == 64 * 4


def test_dynamic_ntk_scales_each_row_by_its_own_length():
    cfg = ModelConfig.from_hf({**BASE, "rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0}})
    rows = torch.stack([torch.arange(100, 110), torch.arange(0, 10)])  # one long, one short row
    both = dynamic_ntk_inv_freq(cfg.rope[FULL], cfg.head_dim, rows)
    alone = dynamic_ntk_inv_freq(cfg.rope[FULL], cfg.head_dim, rows[1:])
    assert torch.equal(both[1], alone[0])
    assert not torch.equal(both[0], both[1])


ROPE_MODELS = {
    "yarn": ("llama", {"max_position_embeddings": 64, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}}),
    "dynamic": ("qwen2", {"max_position_embeddings": 24, "rope_parameters": {
        "rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}}),
}


@pytest.fixture(scope="module")
def rope_dirs(tmp_path_factory):
    from firstlight.models.tiny import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("rope")
    return {k: write_tiny_checkpoint(root / k, fam, seed=5, **over) for k, (fam, over) in ROPE_MODELS.items()}


@pytest.mark.parametrize("kind", sorted(ROPE_MODELS))
def test_rope_scaled_model_matches_reference(rope_dirs, kind):
    ours, tok = load_model(rope_dirs[kind])
    ref = hf_reference(rope_dirs[kind])
    # 40 tokens: past the trained length (16 for yarn's original, 24 for dynamic), so scaling acts
    ids = torch.randint(0, ours.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    abs_err, rel_err = logit_errors(ours, ref, ids)
    assert rel_err <= FP32_REL_TOL, f"{kind}: max abs {abs_err:.3g}, relative {rel_err:.3g}"
    prompt = tok.encode("The capital of France is")
    # 32 new tokens take the dynamic model from its trained 24 positions to ~40: the base grows each step
    assert our_greedy(ours, prompt, 32) == hf_greedy(ref, prompt, 32)
