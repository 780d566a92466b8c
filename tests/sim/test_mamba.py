"""Mamba-2 hybrids (Granite 4.0-H) priced from their config.json, and MTP speculation in `sim serve`."""

import json

import pytest
from typer.testing import CliRunner

from firstlight.core.hardware import load_spec
from firstlight.sim.cli import app, parse_batch
from firstlight.sim.cost import CostModel
from firstlight.sim.model import ModelConfigError, load_model, model_from_config
from firstlight.sim.parallel import ParallelConfig, plan_memory
from firstlight.sim.serve import ServeConfig, run_serve
from firstlight.sim.speculative import SpecCost, SpeculativeError, expected_tokens_per_step, mtp_model
from firstlight.sim.workload import make_workload

H, V = 64, 384  # hidden, vocab
MH, MP, MG, MN, MK = 8, 16, 2, 16, 4  # mamba heads, head dim, groups, state, conv kernel
GRANITE = {  # the shape of the hub's config.json (transformers 4 spelling of layer_types)
    "architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid", "hidden_size": H,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": V,
    "intermediate_size": 32, "shared_intermediate_size": 48, "num_local_experts": 4, "num_experts_per_tok": 2,
    "layer_types": ["mamba", "mamba", "attention", "mamba"], "position_embedding_type": "nope",
    "mamba_n_heads": MH, "mamba_d_head": MP, "mamba_n_groups": MG, "mamba_d_state": MN, "mamba_d_conv": MK,
    "mamba_expand": 2, "mamba_chunk_size": 8, "mamba_conv_bias": True, "mamba_proj_bias": False,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "attention_multiplier": 0.2,
}
INNER = MH * MP  # 128 = mamba_expand x hidden
CONV = INNER + 2 * MG * MN  # x | B | C


def _granite(tmp_path, **over):
    p = tmp_path / "config.json"
    p.write_text(json.dumps({**GRANITE, **over}))
    return load_model(p)


def test_granite_parameters_total_and_active_by_hand(tmp_path):
    m = _granite(tmp_path)
    norms = 2 * H
    mamba = H * (INNER + CONV + MH) + MK * CONV + CONV + INNER * H + 3 * MH + INNER  # in_proj, conv w+b, out_proj, dt/A/D, norm
    attn = H * (4 + 2 * 2) * 16 + 4 * 16 * H  # q|k|v, o (head_dim 16)
    expert = 3 * H * 32
    shared = 3 * H * 48
    router = H * 4
    total_layer = {"mamba": mamba, "attention": attn}
    total = sum(total_layer[t] + norms + router + shared + 4 * expert for t in GRANITE["layer_types"])
    active = sum(total_layer[t] + norms + router + shared + 2 * expert for t in GRANITE["layer_types"])
    emb = 2 * V * H + H  # untied embedding + LM head, final norm
    assert m.num_params() == total + emb
    assert m.num_active_params() == active + emb
    assert m.params_by_group()["experts"] == 4 * 4 * expert
    assert [g.mixer for g in m.groups] == ["mamba2", "attention"] and m.groups[0].num_layers == 3
    assert m.summary()["groups"][0]["mixer"] == "mamba2"


def test_granite_state_is_fixed_and_only_attention_keeps_kv(tmp_path):
    m = _granite(tmp_path)
    # per Mamba layer: SSM state [H, P, N] fp32 + conv state [conv_dim, K-1] at bf16
    assert m.state_bytes_per_seq() == 3 * (MH * MP * MN * 4 + CONV * (MK - 1) * 2)
    # KV for the one attention layer: (K, V) x 2 heads x 16 dims x bf16
    assert m.kv_bytes_per_token() == 2 * 2 * 16 * 2
    assert m.kv_bytes_for_context(2000) == 2000 * m.kv_bytes_per_token()
    assert m.kv_bytes_for_context(4000) == 2 * m.kv_bytes_for_context(2000)  # KV grows with context ...
    assert m.state_bytes_per_seq() == _granite(tmp_path, max_position_embeddings=10**6).state_bytes_per_seq()  # state not
    # decode FLOPs: the recurrence 5 H P N per Mamba layer, independent of context; attention grows
    assert m.flops_per_token(1000) - m.flops_per_token(0) == 1 * 2 * 4 * (16 + 16) * 1000
    # the memory plan holds the state of max_num_seqs sequences back from the KV
    hw = load_spec("h100")
    p1 = plan_memory(m, hw, ParallelConfig(), max_num_seqs=1)
    p2 = plan_memory(m, hw, ParallelConfig(), max_num_seqs=1001)
    assert p2.state_bytes - p1.state_bytes == 1000 * m.state_bytes_per_seq()
    for p in (p1, p2):
        free = p.capacity_bytes - p.weight_bytes - p.activation_bytes - p.state_bytes
        assert p.kv_capacity_tokens == int(free // m.kv_bytes_per_token())
    assert p2.to_dict()["state_bytes_per_seq"] == m.state_bytes_per_seq()


def test_granite_layer_type_spellings_and_errors(tmp_path):
    tf5 = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]  # transformers 5 spelling
    a = _granite(tmp_path)
    b = _granite(tmp_path, layer_types=tf5)
    c = _granite(tmp_path, layer_types=None, layers_block_type=GRANITE["layer_types"])
    assert a.num_params() == b.num_params() == c.num_params() and b.state_bytes_per_seq() == a.state_bytes_per_seq()
    with pytest.raises(ModelConfigError, match=r"unknown type\(s\) \['moe'\]"):
        model_from_config({**GRANITE, "layer_types": ["mamba", "moe", "attention", "mamba"]})
    with pytest.raises(ModelConfigError, match="3 entries, expected 4"):
        model_from_config({**GRANITE, "layer_types": ["mamba", "mamba", "attention"]})
    dense = model_from_config({**GRANITE, "num_local_experts": 0, "num_experts_per_tok": 0})
    assert not dense.is_moe and dense.num_params() == dense.num_active_params()


def test_granite_step_prices_the_ssd_scan(tmp_path):
    m = _granite(tmp_path)
    cm = CostModel(m, load_spec("h100"), ParallelConfig())
    ops = cm.attention_ops(num_decode=8, decode_ctx_sum=8 * 100, prefill_chunks=[])
    scan = next(o for o in ops if o.name == "mamba2_scan")
    assert scan.flops == 3 * 8 * 5 * MH * MP * MN  # 3 layers x 8 tokens x the recurrence
    # decode scan cost does not grow with the context; attention does
    ops2 = cm.attention_ops(num_decode=8, decode_ctx_sum=8 * 10000, prefill_chunks=[])
    assert next(o for o in ops2 if o.name == "mamba2_scan") == scan
    assert next(o for o in ops2 if o.name == "attention").bytes > next(o for o in ops if o.name == "attention").bytes
    # prefill: chunked SSD, 2 Q (G N + H P) + 4 H P N per token (+ a state hand-off per chunk)
    pre = next(o for o in cm.attention_ops(0, 0.0, [(64, 0)]) if o.name == "mamba2_scan")
    q = 8
    assert pre.flops == 3 * (64 * (2 * q * (MG * MN + MH * MP) + 4 * MH * MP * MN) + 8 * MH * MP * MN)
    names = {o.name for o in cm.breakdown(parse_batch("decode:4@100,prefill:32"))}
    assert {"mamba_in_proj", "mamba_out_proj", "mamba_conv1d", "mamba2_scan", "attention"} <= names


def test_granite_presets_match_published_sizes():
    tiny = load_model("granite-4.0-h-tiny")  # IBM: 7B total, ~1B active
    assert tiny.num_params() / 1e9 == pytest.approx(6.94, abs=0.05)
    assert 1.0e9 < tiny.num_active_params() < 1.5e9
    assert tiny.kv_bytes_per_token() == 4 * 2 * 4 * 128 * 2  # 4 attention layers of 40
    # 36 Mamba layers x (48 x 64 x 128 fp32 + (3072 + 256) x 3 bf16)
    assert tiny.state_bytes_per_seq() == 36 * (48 * 64 * 128 * 4 + (3072 + 256) * 3 * 2)
    assert load_model("granite-4.0-h-1b").num_params() / 1e9 == pytest.approx(1.46, abs=0.02)  # "1.5B"


def test_expected_tokens_per_step():
    assert expected_tokens_per_step(0.0, 3) == 1.0
    assert expected_tokens_per_step(1.0, 3) == 4.0
    assert expected_tokens_per_step(0.7, 1) == pytest.approx(1.7)
    assert expected_tokens_per_step(0.5, 2) == pytest.approx(1.75)
    with pytest.raises(SpeculativeError, match="mtp-acceptance"):
        expected_tokens_per_step(1.5, 1)


def test_mtp_decode_step_scales_with_acceptance():
    m = load_model("llama-3.1-8b")
    hw = load_spec("h100")
    cost = CostModel(m, hw, ParallelConfig())
    draft = CostModel(mtp_model(m), hw, ParallelConfig())
    nd, ctx = 32, 32 * 2048.0
    verify = cost.step_time(nd * 3, nd, 0, 0.0, [(3, 2047.0)] * nd)  # k = 2: 3 tokens verified per sequence
    for a in (0.0, 0.5, 0.8, 1.0):
        spec = SpecCost(cost, a, 2, draft)
        t = spec.step_time(nd, nd, nd, ctx)
        assert t * expected_tokens_per_step(a, 2) == pytest.approx(verify + spec.draft_time(nd, ctx))
    # one MTP layer of 32: drafting is a small part of the step
    assert 0 < SpecCost(cost, 0.8, 2, draft).draft_time(nd, ctx) < 0.3 * verify
    # at high acceptance a decode token costs less than without speculation (memory-bound decode)
    assert SpecCost(cost, 0.8, 2, draft).step_time(nd, nd, nd, ctx) < cost.step_time(nd, nd, nd, ctx)
    # prefill-only steps are not touched; mixed steps scale only the decodes' share
    spec = SpecCost(cost, 0.8, 2, draft)
    assert spec.step_time(512, 1, 0, 0.0, [(512, 0)]) == cost.step_time(512, 1, 0, 0.0, [(512, 0)])
    mixed = spec.step_time(512 + nd, nd + 1, nd, ctx, [(512, 0)])
    assert cost.step_time(512, 1, 0, 0.0, [(512, 0)]) < mixed < cost.step_time(512 + 3 * nd, nd + 1, 0, 0.0,
                                                                                [(512, 0)] + [(3, 2047.0)] * nd)


def test_serve_with_mtp_reports_and_speeds_up_tpot():
    m = load_model("llama-3.1-8b")
    hw = load_spec("h100")
    wl = make_workload(60, 2.0, 256, 64, "poisson", 1.0, "fixed", 0)
    base, _ = run_serve(m, hw, wl, ServeConfig())
    fast, _ = run_serve(m, hw, wl, ServeConfig(mtp_acceptance=0.8, mtp_tokens=2))
    assert base["speculative"] is None
    assert fast["speculative"]["expected_tokens_per_step"] == pytest.approx(expected_tokens_per_step(0.8, 2))
    assert fast["tpot_s"]["p50"] < base["tpot_s"]["p50"]
    with pytest.raises(SpeculativeError, match="pp > 1"):
        run_serve(m, hw, wl, ServeConfig(pp=2, mtp_acceptance=0.5))


def test_cli_serve_mtp_and_fit_state(tmp_path):
    r = CliRunner().invoke(app, ["serve", "--hw", "h100", "--model", "granite-4.0-h-tiny", "--rate", "2",
                                 "--num-requests", "20", "--mtp-acceptance", "0.7", "--mtp-tokens", "1"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout[r.stdout.index("{"):])
    assert out["speculative"]["expected_tokens_per_step"] == pytest.approx(1.7)
    r = CliRunner().invoke(app, ["fit", "--hw", "h100", "--model", "granite-4.0-h-tiny", "--max-num-seqs", "64"])
    assert r.exit_code == 0, r.output
    fit = json.loads(r.stdout[r.stdout.index("{"):])
    tiny = load_model("granite-4.0-h-tiny")
    assert fit["state_bytes_per_seq"] == tiny.state_bytes_per_seq()
    assert fit["kv_bytes_per_token"] == tiny.kv_bytes_per_token()


NEMOTRON_H = {  # one block per layer: M Mamba-2, * attention, - MLP (relu2, ungated), E MoE
    "model_type": "nemotron_h", "hidden_size": H, "num_hidden_layers": 6, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96, "vocab_size": V,
    "hybrid_override_pattern": "M-M*EM", "mamba_num_heads": MH, "mamba_head_dim": MP, "n_groups": MG,
    "ssm_state_size": MN, "conv_kernel": MK, "expand": 2, "chunk_size": 8, "use_conv_bias": True,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1,
    "moe_shared_expert_intermediate_size": 40, "tie_word_embeddings": False,
}


def test_nemotron_h_pattern_by_hand():
    m = model_from_config(NEMOTRON_H)
    mamba = H * (INNER + CONV + MH) + MK * CONV + CONV + INNER * H + 3 * MH + INNER
    attn = H * (4 + 2 * 2) * 16 + 4 * 16 * H
    mlp = 2 * H * 96  # up, down
    moe_total = H * 4 + 4 + 4 * 2 * H * 32 + 2 * H * 40  # router + its bias, 4 experts, shared
    moe_active = H * 4 + 4 + 2 * 2 * H * 32 + 2 * H * 40
    body = 3 * mamba + mlp + attn + 6 * H  # one norm per layer
    emb = 2 * V * H + H
    assert m.num_params() == body + moe_total + emb
    assert m.num_active_params() == body + moe_active + emb
    assert sorted((g.mixer, g.num_layers) for g in m.groups) == [("attention", 1), ("mamba2", 3), ("none", 1), ("none", 1)]
    assert m.kv_bytes_per_token() == 2 * 2 * 16 * 2  # the one * layer
    assert m.state_bytes_per_seq() == 3 * (MH * MP * MN * 4 + CONV * (MK - 1) * 2)
    cm = CostModel(m, load_spec("h100"), ParallelConfig())
    names = [o.name for o in cm.attention_ops(4, 400.0, [(16, 0)])]
    assert names == ["mamba2_scan", "attention"]  # MLP-only layers add no mixer op
    assert cm.step_time(20, 5, 4, 400.0, [(16, 0)]) > 0
    with pytest.raises(ModelConfigError, match=r"unknown type\(s\) \['X'\]"):
        model_from_config({**NEMOTRON_H, "hybrid_override_pattern": "M-M*XM"})
    with pytest.raises(ModelConfigError, match="5 entries, expected 6"):
        model_from_config({**NEMOTRON_H, "hybrid_override_pattern": "M-M*E"})


def test_nemotron_h_config_as_transformers_writes_it_counts_our_models_params(tiny_checkpoint):
    """The tiny Nemotron-H's config.json as transformers 5 saves it (`layers_block_type` in words, no
    num_hidden_layers, Mamba projection biases per use_bias) prices the model firstlight loads from it."""
    from firstlight.models.loader import load_model as load_ours

    ckpt = tiny_checkpoint("nemotron_h")
    cfg = json.loads((ckpt / "config.json").read_text())
    assert "num_hidden_layers" not in cfg and "linear_attention" in cfg["layers_block_type"]
    m = model_from_config(cfg)
    ours, _ = load_ours(ckpt, with_tokenizer=False)
    bias = sum(b.numel() for n, b in ours.named_buffers() if n.endswith("e_score_correction_bias"))
    assert m.num_params() == sum(p.numel() for p in ours.parameters()) + bias
    assert m.kv_bytes_per_token() == 2 * 2 * 16 * 2  # the one attention layer, bf16


def test_nemotron_h_8b_shape_is_8b():
    pat = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"  # Nemotron-H-8B: 4 attention layers of 52
    m = model_from_config({
        "model_type": "nemotron_h", "hidden_size": 4096, "num_hidden_layers": 52, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 21504, "vocab_size": 131072,
        "hybrid_override_pattern": pat, "mamba_num_heads": 128, "mamba_head_dim": 64, "n_groups": 8,
        "ssm_state_size": 128, "conv_kernel": 4, "expand": 2, "chunk_size": 128})
    assert m.num_params() / 1e9 == pytest.approx(8.1, abs=0.1)  # NVIDIA: "8B"
    assert m.kv_bytes_per_token() == 4 * 2 * 8 * 128 * 2
