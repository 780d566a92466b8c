"""DeepSeek-V3: the config's derived fields and its bad inputs named, the checkpoint's names, the MLA cache
(one latent row per token, the same values transformers caches), variants of the layer (no q bottleneck,
plain rope, biases, one expert group) against transformers, a hub-shaped config agreeing with `firstlight
sim`, and the MTP layer (loaded from the files' `model.layers.{N}`, against a rebuild from transformers'
modules, `--speculative mtp` in the engine, missing MTP weights named). Logit parity, greedy, incremental and chunked prefill of
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
    # the MTP depths: ours `mtp.{i}`, the files' `model.layers.{i}` (i >= num_hidden_layers)
    assert hf_name("mtp.4.eh_proj.weight", DS) == ["model.layers.4.eh_proj.weight"]
    assert hf_name("mtp.4.shared_head.norm.weight", DS) == ["model.layers.4.shared_head.norm.weight"]
    assert hf_name("mtp.4.mlp.shared_experts.gate_up_proj.weight", DS) == [
        "model.layers.4.mlp.shared_experts.gate_proj.weight", "model.layers.4.mlp.shared_experts.up_proj.weight"]
    assert hf_module_name("mtp.4.self_attn", DS) == "model.layers.4.self_attn"


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


def test_mtp_layer_loads_from_the_files_layout(tiny_dirs, tmp_path):
    """The tiny checkpoint carries its MTP layer as the hub does (`model.layers.4.*`, with copies of the
    embedding and LM head, which are not read); a layer beyond the MTP count is an unused tensor, named."""
    from safetensors.torch import load_file, save_file

    model, _ = load_model(tiny_dirs[DS], with_tokenizer=False)
    assert model.config.num_mtp_layers == 1 and len(model.layers) == 4 and list(model.mtp) == ["4"]
    depth = model.mtp.depth(0)
    assert type(depth.mlp).__name__ == "DeepseekV3MoE" and depth.self_attn.layer == 4  # caches as layer 4
    assert {n.split(".")[1] for n, _ in model.mtp.named_parameters()} >= {"enorm", "hnorm", "eh_proj", "shared_head"}
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_dirs[DS], ckpt)
    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.layers.5.enorm.weight"] = torch.zeros(64)
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="does not use: model.layers.5.enorm.weight"):
        load_model(ckpt, with_tokenizer=False)


@torch.no_grad()
def test_mtp_matches_a_rebuild_from_transformers_modules(tiny_dirs):
    """transformers skips the MTP layer on load, so verify has no reference for it. Instead: the layer
    rebuilt from transformers' own modules (DeepseekV3DecoderLayer at index N, DeepseekV3RMSNorm, a plain
    eh_proj) with the weights read from the checkpoint file, composed as vLLM's deepseek_mtp.py does:
    head(shared_head.norm(layer(eh_proj([enorm(embed(t+1)), hnorm(hidden_t)])))), embedding and head the
    file's copies in that layer. Ours also with a KV cache, prefill then one token at a time."""
    from safetensors.torch import load_file
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

    from tests.models.parity import tensor_from_files

    ckpt = tiny_dirs[DS]
    ref = hf_reference(ckpt)
    model, _ = load_model(ckpt, with_tokenizer=False)
    files = load_file(ckpt / "model.safetensors")
    cfg = ref.config
    n, e = cfg.num_hidden_layers, cfg.hidden_size
    layer = DeepseekV3DecoderLayer(cfg, n).eval()
    assert type(layer.mlp).__name__ == "DeepseekV3MoE"
    layer.load_state_dict({k: tensor_from_files(files, f"model.layers.{n}.{k}", DS, cfg.n_routed_experts)
                           for k in layer.state_dict()})
    norms = {k: DeepseekV3RMSNorm(e, eps=cfg.rms_norm_eps) for k in ("enorm", "hnorm", "shared_head.norm")}
    for k, norm in norms.items():
        norm.load_state_dict({"weight": files[f"model.layers.{n}.{k}.weight"]})
    eh_proj = torch.nn.Linear(2 * e, e, bias=False)
    eh_proj.load_state_dict({"weight": files[f"model.layers.{n}.eh_proj.weight"]})
    embed = torch.nn.Embedding.from_pretrained(files[f"model.layers.{n}.embed_tokens.weight"])
    head = files[f"model.layers.{n}.shared_head.head.weight"]

    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(8)[None].expand(2, -1)
    hidden = model.forward_hidden(ids, torch.arange(9)[None].expand(2, -1))[:, :-1]  # final normed states
    ours = model.forward_mtp(hidden, ids[:, 1:], pos)
    x = eh_proj(torch.cat([norms["enorm"](embed(ids[:, 1:])), norms["hnorm"](hidden)], dim=-1))
    x = layer(x, position_embeddings=ref.model.rotary_emb(x, pos), attention_mask=None, position_ids=pos)
    theirs = norms["shared_head.norm"](x)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(model.compute_logits(ours), theirs @ head.T, rtol=1e-4, atol=1e-4)

    cfg_ours = model.config
    cache = ContiguousKVCache(n + 1, 2, cfg_ours.num_kv_heads, cfg_ours.head_dim, 8)  # the MTP layer: index n
    steps = [model.forward_mtp(hidden[:, :5], ids[:, 1:6], pos[:, :5], cache)]
    steps += [model.forward_mtp(hidden[:, p : p + 1], ids[:, p + 1 : p + 2], pos[:, p : p + 1], cache) for p in (5, 6, 7)]
    torch.testing.assert_close(torch.cat(steps, dim=1), ours, rtol=1e-4, atol=1e-5)
    assert cache.k[n].abs().sum() > 0 and all(cache.k[i].abs().sum() == 0 for i in range(n))


def test_mtp_speculation_keeps_greedy_output(tiny_checkpoint):
    """`--speculative mtp` with the checkpoint's MTP layer: 6 staggered prompts, chunked prefill next to
    verify passes, k = 3; tokens identical to the engine without speculation."""
    from firstlight.engine.speculative.config import SpecConfig
    from tests.engine.test_engine import prompts, run_staggered
    from tests.speculative.test_mtp import GREEDY, _engine, _tokens

    model, tok = load_model(tiny_checkpoint(DS, seed=2))
    plain = _tokens(run_staggered(_engine(model, tok, None), prompts(6, seed=4), GREEDY))
    engine = _engine(model, tok, SpecConfig("mtp", num_spec_tokens=3))
    assert _tokens(run_staggered(engine, prompts(6, seed=4), GREEDY)) == plain
    assert engine.spec.stats.num_drafts > 20 and engine.kv.num_used_blocks == 0


def test_missing_mtp_weights_are_named(tiny_dirs, tmp_path):
    """Files without the MTP layer (conversions drop it, the config still says 1) load the main model, and
    `--speculative mtp` names the field and the missing layer; so does a config with 0 MTP layers. Files
    with part of the layer fail to load, naming the tensor."""
    from safetensors.torch import load_file, save_file

    from firstlight.engine.speculative.config import SpecConfig
    from firstlight.errors import FirstlightError
    from tests.speculative.test_mtp import _engine

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_dirs[DS], ckpt)
    tensors = load_file(ckpt / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if not k.startswith("model.layers.4.")}, ckpt / "model.safetensors",
              metadata={"format": "pt"})
    model, tok = load_model(ckpt)
    assert model.mtp is None
    with pytest.raises(FirstlightError, match=r"num_nextn_predict_layers = 1 and no model\.layers\.4\.\* weights"):
        _engine(model, tok, SpecConfig("mtp"))
    no_mtp, tok = load_model(write_tiny_checkpoint(tmp_path / "no-mtp", DS, seed=1, num_nextn_predict_layers=0))
    with pytest.raises(FirstlightError, match=r"num_nextn_predict_layers = 0 and no model\.layers\.4\.\* weights"):
        _engine(no_mtp, tok, SpecConfig("mtp"))
    save_file({k: v for k, v in tensors.items() if k != "model.layers.4.eh_proj.weight"}, ckpt / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"tensor model.layers.4.eh_proj.weight is missing"):
        load_model(ckpt, with_tokenizer=False)


def test_hub_config_agrees_with_the_simulator():
    """DeepSeek-V3's config (the simulator's preset) builds on the meta device with the simulator's
    parameter count (671B without MTP), and our cache keeps its KV bytes per token (61 x 576 values). With
    its MTP layer: the 11.5B unique MTP parameters of DeepSeek's weight notes, 685B with the files' copies
    of the embedding and head."""
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
    with_mtp = ModelConfig.from_hf({**PRESETS["deepseek-v3"], "num_nextn_predict_layers": 1})
    with torch.device("meta"):
        mtp = sum(p.numel() for p in model_class(with_mtp)(with_mtp).mtp.parameters())
    copies = 2 * cfg.vocab_size * cfg.hidden_size  # model.layers.61.embed_tokens and .shared_head.head
    assert mtp / 1e9 == pytest.approx(11.6, abs=0.1)
    assert (ours + mtp + copies) / 1e9 == pytest.approx(685, abs=1)
