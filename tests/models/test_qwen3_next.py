"""Qwen3-Next pieces: the chunked delta rule against its recurrence, the layer pattern, MTP weights."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from firstlight.errors import ModelLoadError
from firstlight.models.config import FULL, LINEAR, ModelConfig
from firstlight.models.gated_deltanet import chunked_delta_rule, l2norm, recurrent_states, recurrent_step
from firstlight.models.loader import load_model


def _inputs(seq: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    b, h, dk, dv = 2, 3, 8, 5
    q = l2norm(torch.randn(b, h, seq, dk, generator=g)) * dk**-0.5
    k = l2norm(torch.randn(b, h, seq, dk, generator=g))
    v = torch.randn(b, h, seq, dv, generator=g)
    decay = -torch.rand(b, h, seq, generator=g)  # log decay in (-1, 0]
    beta = torch.rand(b, h, seq, generator=g)
    state = torch.randn(b, h, dk, dv, generator=g)
    return q, k, v, decay, beta, state


@pytest.mark.parametrize(("seq", "chunk"), [(1, 4), (7, 4), (8, 4), (21, 8), (5, 64)])
def test_chunked_delta_rule_equals_the_recurrence(seq, chunk):
    """Chunk-parallel prefill (with padding of the last chunk) == token-by-token, outputs and state."""
    q, k, v, g, beta, state = _inputs(seq)
    out_c, state_c = chunked_delta_rule(q, k, v, g, beta, state, chunk=chunk)
    out_r, state_r = recurrent_step(q, k, v, g, beta, state)
    assert torch.allclose(out_c, out_r, atol=1e-5)
    assert torch.allclose(state_c, state_r, atol=1e-5)


def test_per_token_states_are_the_states_after_each_prefix():
    """What a speculative verify pass keeps: state i == the state after running tokens 0 .. i alone."""
    q, k, v, g, beta, state = _inputs(5)
    out, states = recurrent_states(q, k, v, g, beta, state)
    assert states.shape == (2, 5, 3, 8, 5) and torch.equal(out, recurrent_step(q, k, v, g, beta, state)[0])
    for i in range(5):
        _, after = recurrent_step(q[:, :, : i + 1], k[:, :, : i + 1], v[:, :, : i + 1], g[:, :, : i + 1],
                                  beta[:, :, : i + 1], state)
        assert torch.equal(states[:, i], after)


def test_delta_rule_writes_what_the_state_does_not_predict():
    """beta = 1, no decay: after writing (k, v), reading with k returns v exactly (the delta rule)."""
    q, k, v, g, beta, state = _inputs(1)
    _, new_state = recurrent_step(q, k, v, torch.zeros_like(g), torch.ones_like(beta), state)
    read = (new_state * k[:, :, 0].unsqueeze(-1)).sum(-2)
    assert torch.allclose(read, v[:, :, 0], atol=1e-5)


def test_layer_pattern_and_derived_fields(tiny_dirs):
    cfg = ModelConfig.from_hf(json.loads((tiny_dirs["qwen3_next"] / "config.json").read_text()))
    assert cfg.layer_types == (LINEAR, LINEAR, LINEAR, FULL)
    assert cfg.kv_layers == (3,) and cfg.state_layers == (0, 1, 2)
    assert cfg.rope[FULL].rotary_dim(cfg.head_dim) == cfg.head_dim // 2
    assert cfg.num_mtp_layers == 1 and cfg.attn_output_gate
    assert cfg.moe.sparse_layers == (True, False, True, True)
    classic = ModelConfig.from_hf({k: v for k, v in cfg.hf.items() if k != "layer_types"} | {"num_hidden_layers": 8})
    assert classic.layer_types == (LINEAR, LINEAR, LINEAR, FULL) * 2  # full_attention_interval 4


def test_mtp_weights_load_and_run(tiny_dirs):
    model, _ = load_model(tiny_dirs["qwen3_next"], with_tokenizer=False)
    assert model.mtp is not None and len(model.mtp.layers) == 1
    ids = torch.randint(0, 384, (1, 6))
    with torch.no_grad():
        hidden = model.forward_hidden(ids, torch.arange(6).unsqueeze(0))
        out = model.forward_mtp(hidden[:, :-1], ids[:, 1:], torch.arange(5).unsqueeze(0))
    assert out.shape == (1, 5, 64) and torch.isfinite(out).all()


def test_mtp_layer_count_is_read_from_the_files_when_the_config_omits_it(tiny_dirs, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_dirs["qwen3_next"], ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["num_nextn_predict_layers"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    model, _ = load_model(ckpt, with_tokenizer=False)
    assert model.config.num_mtp_layers == 1 and model.mtp is not None


def test_missing_mtp_weight_is_named(tiny_dirs, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_dirs["qwen3_next"], ckpt)
    tensors = load_file(ckpt / "model.safetensors")
    del tensors["mtp.fc.weight"]
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"tensor mtp.fc.weight is missing"):
        load_model(ckpt, with_tokenizer=False)


def test_mtp_matches_a_reimplementation_from_transformers_modules(tiny_dirs):
    check_mtp_against_transformers_modules(tiny_dirs["qwen3_next"], "qwen3_next")


def check_mtp_against_transformers_modules(ckpt, family: str) -> None:
    """transformers has no MTP module (it skips `mtp.*`), so verify has no reference for it. Instead:
    the MTP layer rebuilt from transformers' own modules of the family (a full-attention MoE decoder
    layer, Gemma-style RMSNorms, a plain fc), with the `mtp.*` weights read from the checkpoint file,
    composed as vLLM's qwen3_next_mtp.py does: norm(layer(fc([norm_e(embed(t+1)), norm_h(hidden_t)])))."""
    from firstlight.verify.harness import load_reference
    from tests.models.parity import tensor_from_files

    ref = load_reference(ckpt)
    model, _ = load_model(ckpt, with_tokenizer=False)
    files = load_file(ckpt / "model.safetensors")
    cfg = ref.config.get_text_config()
    full = cfg.layer_types.index("full_attention")
    assert full == 3 and model.config.moe.sparse_layers[full]  # the MTP layer's kind: full attention, sparse MoE
    layer = type(ref.model.layers[full])(cfg, full).eval()
    norms = {n: type(ref.model.norm)(cfg.hidden_size, eps=cfg.rms_norm_eps) for n in
             ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
    fc = torch.nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)

    layer.load_state_dict({n: tensor_from_files(files, f"mtp.layers.0.{n}", family, cfg.num_experts)
                           for n in layer.state_dict()})
    for n, mod in norms.items():
        mod.load_state_dict({"weight": files[f"mtp.{n}.weight"]})
    fc.load_state_dict({"weight": files["mtp.fc.weight"]})

    ids = torch.randint(0, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(6)[None].expand(2, -1)
    with torch.no_grad():
        hidden = model.forward_hidden(ids, torch.arange(7)[None].expand(2, -1))[:, :-1]  # final normed states
        ours = model.forward_mtp(hidden, ids[:, 1:], pos)
        e = norms["pre_fc_norm_embedding"](ref.model.embed_tokens(ids[:, 1:]))
        x = fc(torch.cat([e, norms["pre_fc_norm_hidden"](hidden)], dim=-1))
        x = layer(x, position_embeddings=ref.model.rotary_emb(x, pos), attention_mask=None, position_ids=pos)
        theirs = norms["norm"](x)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
