"""Verify on MoE and hybrid families: eager matches, and faults planted inside the router/experts,
the shared expert, the linear-attention and Mamba-2 mixers are localized to that module and layer."""

from __future__ import annotations

import pytest
import torch

from firstlight.targets.base import Target, TargetError
from firstlight.targets.faulty import Fault, FaultyTarget
from firstlight.targets.registry import get_target
from firstlight.verify.harness import VerifyConfig, run_verify

CFG = VerifyConfig(new_tokens=8, ppl_tokens=0)


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_next", "qwen3_5_moe", "granitemoehybrid", "nemotron_h",
                                    "deepseek_v3"])
def test_eager_matches_reference(tiny_dirs, references, family):
    res = run_verify(tiny_dirs[family], get_target("eager"), "eager", config=CFG, reference=references(family))
    assert res.verdict == "match"


PLANTED = [
    pytest.param("mixtral", Fault("noise", op="aten._grouped_mm", layer=1, value=0.2),
                 "aten._grouped_mm", "layers.1.mlp.experts", 1, id="experts-grouped-gemm-mixtral"),
    # the router's logits (Qwen3-MoE's `mlp.gate`): a wrong routing is blamed on the router, not the experts
    pytest.param("qwen3_moe", Fault("noise", op="aten.mm", module="layers.1.mlp.gate", value=0.5),
                 "aten.mm", "layers.1.mlp.gate", 1, id="router-qwen3_moe"),
    pytest.param("qwen2_moe", Fault("noise", op="aten.mm", module="layers.1.mlp.shared_expert.down_proj", value=0.2),
                 "aten.mm", "layers.1.mlp.shared_expert.down_proj", 1, id="shared-expert-qwen2_moe"),
    pytest.param("qwen3_next", Fault("scale", op="aten.softplus", layer=2, value=1.5),
                 "aten.softplus", "layers.2.linear_attn", 2, id="deltanet-decay-qwen3_next"),
    pytest.param("qwen3_next", Fault("noise", op="aten._grouped_mm", layer=0, nth=1, value=0.2),
                 "aten._grouped_mm", "layers.0.mlp.experts", 0, id="experts-down-qwen3_next"),
    # Qwen3.5-MoE: the flat Gated DeltaNet in-projection (one fused matmul of four HF linears), the shared expert
    pytest.param("qwen3_5_moe", Fault("noise", op="aten.mm", module="layers.1.linear_attn.in_proj", value=0.2),
                 "aten.mm", "layers.1.linear_attn.in_proj", 1, id="deltanet-in-proj-qwen3_5_moe"),
    pytest.param("qwen3_5_moe", Fault("noise", op="aten.mm", module="layers.3.mlp.shared_expert.down_proj", value=0.2),
                 "aten.mm", "layers.3.mlp.shared_expert.down_proj", 3, id="shared-expert-qwen3_5_moe"),
    # Granite 4.0-H (layers: mamba, mamba, attention, mamba): Mamba-2 step size, experts, shared MLP
    pytest.param("granitemoehybrid", Fault("scale", op="aten.softplus", layer=1, value=1.5),
                 "aten.softplus", "layers.1.mamba", 1, id="mamba-step-granite"),
    pytest.param("granitemoehybrid", Fault("noise", op="aten._grouped_mm", layer=2, nth=1, value=0.2),
                 "aten._grouped_mm", "layers.2.block_sparse_moe.experts", 2, id="experts-down-granite"),
    pytest.param("granitemoehybrid", Fault("noise", op="aten.mm", module="layers.3.shared_mlp.down_proj", value=0.2),
                 "aten.mm", "layers.3.shared_mlp.down_proj", 3, id="shared-mlp-granite"),
    # Nemotron-H ("M-M*-EM", one module per layer): Mamba-2 step size, an MLP block, the MoE's experts
    pytest.param("nemotron_h", Fault("scale", op="aten.softplus", layer=2, value=1.5),
                 "aten.softplus", "layers.2.mixer", 2, id="mamba-step-nemotron"),
    pytest.param("nemotron_h", Fault("noise", op="aten.mm", module="layers.4.mixer.down_proj", value=0.2),
                 "aten.mm", "layers.4.mixer.down_proj", 4, id="mlp-block-nemotron"),
    pytest.param("nemotron_h", Fault("noise", op="aten._grouped_mm", layer=5, nth=1, value=0.2),
                 "aten._grouped_mm", "layers.5.mixer.experts", 5, id="experts-down-nemotron"),
    # DeepSeek-V3 (one dense layer, then MoE): MLA's latent projection, the shared experts, the routed experts
    pytest.param("deepseek_v3", Fault("noise", op="aten.mm", module="layers.2.self_attn.kv_a_proj_with_mqa", value=0.2),
                 "aten.mm", "layers.2.self_attn.kv_a_proj_with_mqa", 2, id="mla-kv-a-proj-deepseek_v3"),
    pytest.param("deepseek_v3", Fault("noise", op="aten.mm", module="layers.1.mlp.shared_experts.down_proj", value=0.2),
                 "aten.mm", "layers.1.mlp.shared_experts.down_proj", 1, id="shared-experts-deepseek_v3"),
    pytest.param("deepseek_v3", Fault("noise", op="aten._grouped_mm", layer=3, nth=1, value=0.2),
                 "aten._grouped_mm", "layers.3.mlp.experts", 3, id="experts-down-deepseek_v3"),
]


@pytest.mark.parametrize(("family", "fault", "op", "module", "layer"), PLANTED)
def test_planted_fault_is_localized(tiny_dirs, references, family, fault, op, module, layer):
    target = FaultyTarget(torch.float32, faults=[fault])
    res = run_verify(tiny_dirs[family], target, "faulty", config=CFG, reference=references(family))
    assert res.verdict == "mismatch" and fault.hits > 0
    c = res.culprit
    assert c is not None, res.first_failing
    assert c["op"].startswith(op) and c["module"] == module and c["layer"] == layer
    assert c["source"].startswith("firstlight/models/")
    assert res.first_failing["unit"] == f"layers.{layer}"


# ---- blaming one expert among the stacked ones ---------------------------------------------------

@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_weight_fault_in_one_expert_is_blamed_on_that_expert(tiny_dirs, references, family):
    """Expert 3's down_proj weight in layer 1 scaled by 1.5: no op fails on the reference's weights,
    and the weight check names the parameter and the expert."""
    fault = Fault("weight", param="layers.1.mlp.experts.down_proj", expert=3, value=1.5)
    res = run_verify(tiny_dirs[family], FaultyTarget(torch.float32, faults=[fault]), "faulty", config=CFG,
                     reference=references(family))
    assert res.verdict == "mismatch" and fault.hits == 1
    assert res.first_failing["unit"] == "layers.1"
    c = res.culprit
    assert c is not None, res.first_failing
    assert (c["op"], c["module"], c["expert"], c["layer"]) == ("weight", "layers.1.mlp.experts.3", 3, 1)
    assert c["param"] == "layers.1.mlp.experts.down_proj"
    assert c["source"].startswith("firstlight/models/moe.py") and "down_proj" in c["code"]
    assert [w["module"] for w in res.first_failing["weights"]] == ["layers.1.mlp.experts.3"]  # only that expert
    assert "expert 3" in res.first_failing["note"]


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_op_fault_in_one_expert_is_blamed_on_that_expert(tiny_dirs, references, family):
    """Only expert 3's rows of layer 1's down-projection grouped GEMM are scaled: the culprit op is the
    grouped GEMM, and its per-expert comparison names expert 3 (the other experts' rows are exact)."""
    fault = Fault("scale", op="aten._grouped_mm", layer=1, nth=1, expert=3, value=1.5)
    res = run_verify(tiny_dirs[family], FaultyTarget(torch.float32, faults=[fault]), "faulty", config=CFG,
                     reference=references(family))
    assert res.verdict == "mismatch" and fault.hits > 0
    c = res.culprit
    assert c is not None, res.first_failing
    assert c["op"].startswith("aten._grouped_mm") and c["module"] == "layers.1.mlp.experts.3" and c["expert"] == 3
    per_expert = {r["expert"]: r["isolated"]["ok"] for r in c["experts"]}
    assert per_expert.pop(3) is False and per_expert and all(per_expert.values())
    assert c["source"].startswith("firstlight/models/moe.py")


def test_weight_fault_outside_experts_names_the_module(tiny_dirs, references):
    fault = Fault("weight", param="layers.2.self_attn.o_proj.weight", value=1.05)
    res = run_verify(tiny_dirs["qwen3_moe"], FaultyTarget(torch.float32, faults=[fault]), "faulty", config=CFG,
                     reference=references("qwen3_moe"))
    c = res.culprit
    assert res.verdict == "mismatch" and c is not None
    assert (c["op"], c["module"], c["expert"], c["layer"]) == ("weight", "layers.2.self_attn.o_proj", None, 2)


def test_weight_fault_options():
    f = FaultyTarget(torch.float32, kind="weight", param="layers.1.mlp.experts.down_proj", expert="3", value="1.5")
    assert (f.faults[0].param, f.faults[0].expert, f.faults[0].value) == ("layers.1.mlp.experts.down_proj", 3, 1.5)
    with pytest.raises(TargetError, match="needs param="):
        Fault("weight")
    with pytest.raises(TargetError, match="no parameter matches param=nope"):
        Fault("weight", param="nope").plant_weight(torch.nn.Linear(2, 2))


# ---- Granite 4.0-H: Mamba-2 mixer, routed experts and shared MLP as boundaries of their own -------

def test_granite_boundaries_name_mixer_experts_and_shared_mlp(tiny_dirs, references):
    """Each layer is compared at its mixer (`mamba` or `self_attn`), the residual stream, the routed
    experts (`block_sparse_moe`) and the shared MLP, every one within tolerance on eager."""
    res = run_verify(tiny_dirs["granitemoehybrid"], get_target("eager"), "eager", config=CFG,
                     reference=references("granitemoehybrid"))
    names = [b["name"] for b in res.boundaries]
    assert names[:6] == ["embed", "layers.0.mamba", "layers.0.resid_mid", "layers.0.block_sparse_moe",
                         "layers.0.shared_mlp", "layers.0"]
    assert "layers.2.self_attn" in names and "layers.2.mamba" not in names  # the attention layer
    assert all(b["isolated"]["ok"] for b in res.boundaries if "isolated" in b)
    assert res.verdict == "match", res.reasons
    # NoPE: the reference has no rotary tables, so none are compared (masks and scales still are)
    assert not [t for t in res.tables if t["name"].startswith("tables.rope")]
    assert any(t["name"].startswith("tables.mask") for t in res.tables)


@pytest.mark.parametrize(("family", "param", "boundary", "source"), [
    pytest.param("granitemoehybrid", "layers.1.mamba.out_proj.weight", "layers.1.mamba", "mamba2.py", id="mamba-granite"),
    pytest.param("nemotron_h", "layers.6.mixer.out_proj.weight", "layers.6.mixer", "mamba2.py", id="mamba-nemotron_h"),
    pytest.param("deepseek_v3", "layers.2.self_attn.kv_a_proj_with_mqa.weight", "layers.2.self_attn", "deepseek_v3.py",
                 id="mla-kv-a-proj-deepseek_v3"),
])
def test_weight_fault_in_a_mixer_is_blamed_on_that_weight(tiny_dirs, references, family, param, boundary, source):
    """The mixer's weight scaled by 1.05: its boundary fails, no op fails on the reference's weights, and
    the weight check names the parameter."""
    fault = Fault("weight", param=param, value=1.05)
    res = run_verify(tiny_dirs[family], FaultyTarget(torch.float32, faults=[fault]), "faulty",
                     config=CFG, reference=references(family))
    assert res.verdict == "mismatch" and fault.hits == 1
    assert res.reasons[0] == f"{boundary}: isolated error over tolerance"
    layer = int(param.split(".")[1])
    assert res.first_failing["unit"] == f"layers.{layer}"
    c = res.culprit
    assert c is not None, res.first_failing
    assert (c["op"], c["param"], c["module"], c["layer"]) == ("weight", param, param.removesuffix(".weight"), layer)
    assert c["source"].startswith(f"firstlight/models/{source}")


def test_sub_layer_units_cover_every_mixer_and_ffn(tiny_dirs):
    """Targets without hooks compile each layer's mixer and FFN modules as units: attention, Gated
    DeltaNet and Mamba-2 mixers, `mlp` or Granite's `block_sparse_moe` + `shared_mlp`, each one
    reproducing the module on the layer's own input."""
    from firstlight.models.loader import load_model
    from firstlight.verify import units as U

    for family in ("qwen3_next", "qwen3_5_moe", "granitemoehybrid"):
        model, _ = load_model(tiny_dirs[family], torch.float32, with_tokenizer=False)
        pos = torch.arange(6)[None]
        rope, masks = model.rope_tables(pos, torch.float32), model.masks(pos, pos)
        h = torch.randn(1, 6, model.config.hidden_size)
        for i, layer in enumerate(model.layers):
            t = layer.layer_type
            mixer = U.attention_unit(model, i)
            out = mixer(h, *rope[t], masks[t], *mixer.params())
            assert out.shape == h.shape and torch.isfinite(out).all()
            for f in U.ffn_subs(layer):
                unit = U.mlp_unit(model, i, f)
                torch.testing.assert_close(unit(h, *unit.params()), getattr(layer, f)(h), rtol=0, atol=0)
                assert unit.key == f and unit.model_path(f"layer.{f}") == f"layers.{i}.{f}"
        if family == "granitemoehybrid":
            assert U.layer_subs(model.layers[0]) == ("mamba", "block_sparse_moe", "shared_mlp")
            assert U.layer_subs(model.layers[2]) == ("self_attn", "block_sparse_moe", "shared_mlp")


class _Miscompiled(Target):
    """A compiling target (no hooks) whose units of the given keys come out 10% too large."""

    name = "miscompiled"
    supports_hooks = False

    def __init__(self, keys: tuple[str, ...]) -> None:
        super().__init__(torch.float32)
        self.keys = keys

    def compile(self, unit, example_inputs, key):
        return (lambda *xs: unit(*xs) * 1.1) if key in self.keys else unit


@pytest.mark.parametrize(("key", "boundary"), [("attn:mamba", "layers.0.mamba"),
                                               ("shared_mlp", "layers.0.shared_mlp"),
                                               ("block_sparse_moe", "layers.0.block_sparse_moe")])
def test_granite_sub_layer_units_without_hooks(tiny_dirs, references, key, boundary):
    """Without hooks the mixer and both FFN modules are compiled units of their own, compared in
    isolation inside the layer: a miscompiled one fails its boundary while the layer units pass."""
    res = run_verify(tiny_dirs["granitemoehybrid"], _Miscompiled((key,)), "miscompiled", config=CFG,
                     reference=references("granitemoehybrid"))
    rows = {b["name"]: b for b in res.boundaries}
    assert {n for n in rows if n.startswith("layers.2.")} == {
        "layers.2.self_attn", "layers.2.block_sparse_moe", "layers.2.shared_mlp"}
    assert rows[boundary]["isolated"]["rel_l2"] == pytest.approx(0.1, rel=1e-3)
    assert all(b["isolated"]["ok"] for n, b in rows.items() if "isolated" in b and not n.endswith(boundary[9:]))
    assert res.verdict == "mismatch" and res.first_failing["unit"] == "layers.0"
    assert res.culprit is None and "how the target compiled the unit" in res.first_failing["note"]


# ---- Nemotron-H: one module per layer, compared as `layers.i.mixer` --------------------------------

def test_nemotron_h_boundaries_are_one_module_per_layer(tiny_dirs, references):
    """Each layer is compared at its one module (`mixer`: Mamba-2, attention, MLP or MoE) and its output;
    there is no residual stream inside a layer to compare. The attention scale is checked."""
    res = run_verify(tiny_dirs["nemotron_h"], get_target("eager"), "eager", config=CFG,
                     reference=references("nemotron_h"))
    names = [b["name"] for b in res.boundaries]
    assert names == ["embed", *(n for i in range(7) for n in (f"layers.{i}.mixer", f"layers.{i}")), "norm", "logits"]
    assert all(b["isolated"]["ok"] for b in res.boundaries if "isolated" in b)
    assert res.verdict == "match", res.reasons
    scale = next(t for t in res.tables if t["name"] == "tables.scale.attention")
    assert scale["ok"] and scale["max_rel_error"] == 0.0


def test_nemotron_h_sub_layer_units(tiny_dirs):
    """Without hooks: a token-mixer block (Mamba-2, attention) is an `attn:<type>` unit, an MLP or MoE
    block a `mixer:<type>` unit, each reproducing the block's module on its own input."""
    from firstlight.models.loader import load_model
    from firstlight.verify import units as U

    model, _ = load_model(tiny_dirs["nemotron_h"], torch.float32, with_tokenizer=False)
    pos = torch.arange(6)[None]
    rope, masks = model.rope_tables(pos, torch.float32), model.masks(pos, pos)
    h = torch.randn(1, 6, model.config.hidden_size)
    keys = []
    for i, layer in enumerate(model.layers):
        assert U.layer_subs(layer) == ("mixer",) and not U.has_resid_mid(layer)
        if U.mixer_sub(layer):
            unit = U.attention_unit(model, i)
            t = layer.layer_type
            out = unit(h, *rope[t], masks[t], *unit.params())
            assert U.ffn_subs(layer) == ()
        else:
            unit = U.mlp_unit(model, i, "mixer")
            out = unit(h, *unit.params())
            torch.testing.assert_close(out, layer.mixer(h), rtol=0, atol=0)
        assert out.shape == h.shape and torch.isfinite(out).all()
        keys.append(unit.key)
    assert keys == ["attn:mamba", "mixer:mlp", "attn:mamba", "attn:full_attention", "mixer:mlp", "mixer:moe",
                    "attn:mamba"]


@pytest.mark.parametrize(("key", "boundary"), [("attn:mamba", "layers.0.mixer"), ("mixer:moe", "layers.5.mixer")])
def test_nemotron_h_sub_layer_units_without_hooks(tiny_dirs, references, key, boundary):
    """A miscompiled block module fails its own boundary, compared in isolation inside the layer."""
    res = run_verify(tiny_dirs["nemotron_h"], _Miscompiled((key,)), "miscompiled", config=CFG,
                     reference=references("nemotron_h"))
    rows = {b["name"]: b for b in res.boundaries}
    assert "layers.1.resid_mid" not in rows and "layers.1.mixer" in rows
    assert rows[boundary]["isolated"]["rel_l2"] == pytest.approx(0.1, rel=1e-3)
    others = [b for n, b in rows.items() if "isolated" in b and n.endswith(".mixer") and n != boundary
              and not (key == "attn:mamba" and n in ("layers.2.mixer", "layers.6.mixer"))]
    assert others and all(b["isolated"]["ok"] for b in others)
    assert res.verdict == "mismatch" and res.culprit is None


# ---- DeepSeek-V3: MLA caches one latent row per token, transformers two tensors ------------------

def test_deepseek_v3_serving_path_compares_the_latent_cache(tiny_dirs, references):
    """The serving path's cached K/V (the latent row in two halves) is compared with transformers' cache
    entries (latent, rope key) in our layout, and the MLA softmax scale (YaRN mscale) with HF's."""
    res = run_verify(tiny_dirs["deepseek_v3"], get_target("eager"), "eager", config=CFG,
                     reference=references("deepseek_v3"))
    kv = res.paths["serve"]["kv_cache"]
    assert kv["ok"] and kv["max_rel_l2"] < 1e-5
    scale = next(t for t in res.tables if t["name"] == "tables.scale.attention")
    assert scale["ok"] and scale["max_rel_error"] == 0.0


def test_deepseek_v3_mla_unit_without_hooks(tiny_dirs, references):
    """A target without hooks compiles MLA as an attention unit of its own: miscompiled, it fails its
    boundary in isolation while the MLP and MoE boundaries pass."""
    res = run_verify(tiny_dirs["deepseek_v3"], _Miscompiled(("attn:full_attention",)), "miscompiled", config=CFG,
                     reference=references("deepseek_v3"))
    rows = {b["name"]: b for b in res.boundaries}
    assert rows["layers.1.self_attn"]["isolated"]["rel_l2"] == pytest.approx(0.1, rel=1e-3)
    mlps = [b for n, b in rows.items() if n.endswith(".mlp")]
    assert len(mlps) == 4 and all(b["isolated"]["ok"] for b in mlps)
    assert res.verdict == "mismatch" and res.first_failing["unit"] == "layers.0"
