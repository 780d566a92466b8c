"""GGUF -> HF conversion of mixture-of-experts models (Mixtral as llama with experts, qwen2moe, qwen3moe).

Each test takes a tiny HF checkpoint of the family (firstlight.models.tiny), writes the GGUF llama.cpp's
convert_hf_to_gguf.py would make of it (per-expert tensors stacked into `ffn_{gate,up,down}_exps`,
router `ffn_gate_inp`, Qwen2-MoE's shared expert `*_shexp`, Mixtral's Q/K permuted, `*.expert_*`
metadata, the checkpoint's own byte-level BPE vocab), converts it back, and checks that every tensor
and the logits of our loaded model equal the original checkpoint's.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter, TokenType, quants
from safetensors.torch import load_file

from firstlight.errors import FirstlightError, UnknownModelError
from firstlight.models.gguf import gguf_to_checkpoint
from firstlight.models.loader import load_model

from .test_gguf import llama_cpp_permute

ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}
# HF name inside model.layers.N -> llama.cpp name inside blk.N (gguf-py tensor_mapping.py)
_BLOCK = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}  # fmt: skip
# per-expert file name (after `experts.{i}.`) -> stacked llama.cpp name
_EXPERT = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
           "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}  # fmt: skip


def _vocab(ckpt: Path) -> tuple[list[str], list[int], list[str]]:
    """The checkpoint's BPE vocab as llama.cpp's `_set_vocab_gpt2` writes it: tokens by id, types, merges."""
    tok = json.loads((ckpt / "tokenizer.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    special = {a["content"] for a in tok["added_tokens"] if a["special"]}
    for a in tok["added_tokens"]:
        vocab[a["content"]] = a["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert len(tokens) == max(vocab.values()) + 1
    types = [int(TokenType.CONTROL if t in special else TokenType.NORMAL) for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    return tokens, types, merges


def write_gguf_from_checkpoint(ckpt: Path, path: Path, f16_experts: bool = False, per_expert: bool = False,
                              q8_experts: bool = False) -> None:
    """What convert_hf_to_gguf.py writes for a Mixtral / Qwen2-MoE / Qwen3-MoE checkpoint (F32 tensors);
    `per_expert`: one `blk.N.ffn_{gate,up,down}.E.weight` per expert, as llama.cpp wrote before stacking them;
    `q8_experts`: the stacked experts in Q8_0 (blocks of 32 int8 with an fp16 scale)."""
    cfg = json.loads((ckpt / "config.json").read_text())
    mt = cfg["model_type"]
    arch = ARCH[mt]
    num_experts = cfg.get("num_local_experts") or cfg["num_experts"]
    w = GGUFWriter(str(path), arch)
    w.add_name(f"Tiny {mt}")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_expert_count(num_experts)
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if mt != "mixtral":  # Qwen2MoeModel.set_gguf_parameters; LlamaModel writes no expert length
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if mt == "qwen2_moe":
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    tokens, types, merges = _vocab(ckpt)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_pad_token_id(cfg["pad_token_id"])
    w.add_add_bos_token(False)

    hf = {k: v.numpy() for k, v in load_file(str(ckpt / "model.safetensors")).items()}
    # prepare_tensors writes `data_torch.squeeze()`: the shared expert gate [1, E] becomes 1-D
    hf = {k: (np.squeeze(v) if k.endswith("shared_expert_gate.weight") else v) for k, v in hf.items()}
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}  # fmt: skip
    for name, gname in top.items():
        if name in hf:
            w.add_tensor(gname, hf[name])
    for i in range(cfg["num_hidden_layers"]):
        prefix = f"model.layers.{i}."
        stacked: dict[str, list[np.ndarray]] = {}
        for name in sorted(n for n in hf if n.startswith(prefix)):
            rest, _, leaf = name[len(prefix):].rpartition(".")
            if ".experts." in rest:
                e, proj = rest.split(".experts.")[1].split(".")
                stacked.setdefault(_EXPERT[proj], [None] * num_experts)[int(e)] = hf[name]
                continue
            t = hf[name]
            if mt == "mixtral" and rest == "self_attn.q_proj":
                t = llama_cpp_permute(t, cfg["num_attention_heads"])
            if mt == "mixtral" and rest == "self_attn.k_proj":
                t = llama_cpp_permute(t, cfg["num_key_value_heads"])
            w.add_tensor(f"blk.{i}.{_BLOCK[rest]}.{leaf}", np.ascontiguousarray(t))
        for gname, parts in stacked.items():
            if per_expert:
                for e, part in enumerate(parts):
                    w.add_tensor(f"blk.{i}.{gname.removesuffix('_exps')}.{e}.weight", part)
                continue
            t = np.stack(parts)  # [X, out, in]
            if q8_experts:
                q = quants.quantize(t, GGMLQuantizationType.Q8_0)
                w.add_tensor(f"blk.{i}.{gname}.weight", q, raw_shape=q.shape, raw_dtype=GGMLQuantizationType.Q8_0)
                continue
            w.add_tensor(f"blk.{i}.{gname}.weight", t.astype(np.float16) if f16_experts else t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint):
    made: dict[str, tuple[Path, Path]] = {}

    def make(family: str) -> tuple[Path, Path]:
        if family not in made:
            src = tiny_checkpoint(family)
            root = tmp_path_factory.mktemp(f"gguf-{family}")
            write_gguf_from_checkpoint(src, root / f"{family}.gguf")
            made[family] = src, gguf_to_checkpoint(root / f"{family}.gguf", root / "ckpt")
        return made[family]

    return make


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_moe_gguf_round_trip_gives_the_same_model(converted, family: str) -> None:
    """Every tensor comes back bit-exact under its HF file name, and our model's logits are identical."""
    src, ckpt = converted(family)
    want, got = load_file(str(src / "model.safetensors")), load_file(str(ckpt / "model.safetensors"))
    assert set(got) == set(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), name
    ids = torch.tensor([[1, 17, 99, 5, 230, 64, 3, 300, 41, 12, 7, 150]])
    ref, _ = load_model(src, with_tokenizer=False)
    ours, tok = load_model(ckpt)
    with torch.no_grad():
        assert torch.equal(ours(ids), ref(ids))
    text = "The quick brown fox is more lovely"
    assert tok(text).input_ids == load_model(src)[1](text).input_ids


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe"])
def test_fixture_gguf_reads_back_in_transformers(converted, family: str) -> None:
    """transformers' own GGUF loader (gguf-py's name mapping) reads the test's GGUF as the original
    model: the fixture writes what llama.cpp writes, so the round trip above is not self-consistent only.
    (transformers reads a llama GGUF with experts as a dense Llama, so Mixtral has no such check; nor does
    it know of dense layers among sparse ones, so it skips those layers' MLPs, as llama.cpp would refuse them.)"""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    src, ckpt = converted(family)
    gguf_path = ckpt.parent / f"{family}.gguf"
    cfg = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    with torch.device("meta"):
        net = AutoModelForCausalLM.from_config(cfg)
    ref = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=net)["tensors"]
    want = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).state_dict()
    dense = {n for n in want if re.match(r"model\.layers\.(0|2)\.mlp\.(gate|up|down)_proj\.", n)}
    assert set(ref) == set(want) - dense and any(".experts." in n for n in ref)
    for name, t in ref.items():
        assert torch.equal(t.float(), want[name]), name


def test_moe_gguf_config(converted) -> None:
    """The config fields MoE loading depends on: counts, widths, dense layers, renormalization."""
    cfgs = {f: json.loads((converted(f)[1] / "config.json").read_text()) for f in ("mixtral", "qwen2_moe", "qwen3_moe")}
    mix, q2, q3 = cfgs["mixtral"], cfgs["qwen2_moe"], cfgs["qwen3_moe"]
    assert mix["model_type"] == "mixtral" and mix["architectures"] == ["MixtralForCausalLM"]
    assert (mix["num_local_experts"], mix["num_experts_per_tok"], mix["intermediate_size"]) == (4, 2, 128)
    assert q2["model_type"] == "qwen2_moe" and q2["norm_topk_prob"] is False and q2["qkv_bias"] is True
    assert (q2["num_experts"], q2["moe_intermediate_size"], q2["shared_expert_intermediate_size"]) == (4, 32, 48)
    assert q2["mlp_only_layers"] == [2] and q2["intermediate_size"] == 128
    assert q3["model_type"] == "qwen3_moe" and q3["norm_topk_prob"] is True and q3["num_experts"] == 8
    assert q3["mlp_only_layers"] == [0, 2] and q3["decoder_sparse_step"] == 1  # tiny: every 2nd layer sparse


def test_qwen3moe_f16_experts(tiny_checkpoint, tmp_path: Path) -> None:
    """F16 stacked experts dequantize to the rounded weights, split per expert."""
    src = tiny_checkpoint("qwen3_moe")
    write_gguf_from_checkpoint(src, tmp_path / "f16.gguf", f16_experts=True)
    got = load_file(str(gguf_to_checkpoint(tmp_path / "f16.gguf", tmp_path / "ckpt") / "model.safetensors"))
    want = load_file(str(src / "model.safetensors"))
    name = "model.layers.1.mlp.experts.5.down_proj.weight"
    assert torch.equal(got[name], want[name].half().float())
    assert not torch.equal(got[name], want[name])  # it was rounded


def _moe_gguf(path: Path, arch: str, num_experts: int = 64) -> Path:
    w = GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_expert_count(num_experts)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("arch", ["deepseek2", "qwen3next"])
def test_unsupported_moe_architectures_are_named(tmp_path: Path, arch: str) -> None:
    path = _moe_gguf(tmp_path / f"{arch}.gguf", arch)
    with pytest.raises(UnknownModelError) as e:
        gguf_to_checkpoint(path, tmp_path / "out")
    msg = str(e.value)
    assert isinstance(e.value, FirstlightError)
    assert f"GGUF architecture '{arch}' (a mixture of experts: {arch}.expert_count = 64) is not supported" in msg
    assert "supported: gemma3, llama, mistral, qwen2, qwen2moe, qwen3, qwen3moe (Mixtral is llama with experts)" in msg
    assert not (tmp_path / "out").exists()


def test_experts_on_a_dense_architecture_are_refused(tmp_path: Path) -> None:
    path = _moe_gguf(tmp_path / "qwen3.gguf", "qwen3", num_experts=8)
    with pytest.raises(UnknownModelError, match="'qwen3' with experts .qwen3.expert_count = 8. is not supported"):
        gguf_to_checkpoint(path, tmp_path / "out")


def test_per_expert_mixtral_gguf_converts(tiny_checkpoint, tmp_path: Path) -> None:
    """Early Mixtral GGUFs keep one tensor per expert (blk.N.ffn_gate.E.weight): same checkpoint back."""
    src = tiny_checkpoint("mixtral")
    write_gguf_from_checkpoint(src, tmp_path / "old.gguf", per_expert=True)
    out = gguf_to_checkpoint(tmp_path / "old.gguf", tmp_path / "ckpt")
    want, got = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert set(got) == set(want)
    for name, t in want.items():
        torch.testing.assert_close(got[name], t, rtol=0, atol=0, msg=name)


def test_q8_0_experts_dequantize_within_the_format(tiny_checkpoint, tmp_path: Path) -> None:
    """Stacked experts stored in Q8_0 come back per expert within Q8_0's rounding: half a step of a block's
    scale (max / 127), 1/254 of the max, plus the fp16 rounding of the scale itself (2^-11 relative)."""
    src = tiny_checkpoint("qwen3_moe")
    write_gguf_from_checkpoint(src, tmp_path / "q8.gguf", q8_experts=True)
    out = gguf_to_checkpoint(tmp_path / "q8.gguf", tmp_path / "ckpt")
    want, got = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    experts = [n for n in want if ".experts." in n]
    assert experts and set(got) == set(want)
    for name in experts:
        err = (got[name] - want[name]).abs().max() / want[name].abs().max()
        assert 0 < err <= 1 / 254 + 2**-11, (name, float(err))
