"""Whole-model quantization on tiny checkpoints: what is replaced, the memory it saves, generation
still running and close to fp32, and errors for formats/devices/shapes that cannot work."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from firstlight.errors import FirstlightError
from firstlight.models.generate import generate_tokens
from firstlight.models.loader import load_model
from firstlight.quant import (
    QuantizationError,
    apply_quantization,
    get_format,
    list_formats,
    model_weight_bytes,
    quantize_model,
)
from firstlight.quant.base import QuantizedModule
from firstlight.quant.int8 import Int8Embedding
from firstlight.quant.w8a8 import W8A8Linear

FORMATS = ["int8", "int4", "fp8", "w8a8"]


def test_registry_lists_the_formats():
    assert set(list_formats()) == {*FORMATS, "w4a8"}  # w4a8: firstlight's CPU kernel only (test_w4a8.py)


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_model_replaces_every_linear_and_shrinks_weights(tiny_dirs, fmt):
    model, _ = load_model(tiny_dirs["llama"], with_tokenizer=False)
    num_linear = sum(isinstance(m, nn.Linear) for m in model.modules())
    before = model_weight_bytes(model)
    report = quantize_model(model, fmt)
    assert not any(isinstance(m, nn.Linear | nn.Embedding) for m in model.modules())
    assert sum(layer.kind == "linear" for layer in report.layers) == num_linear
    assert [layer.name for layer in report.layers if layer.kind == "embedding"] == ["embed_tokens"]
    assert report.weight_bytes_before == before and report.weight_bytes_after == model_weight_bytes(model)
    assert report.compression > {"int8": 3.0, "fp8": 3.0, "int4": 3.5, "w8a8": 3.0}[fmt]
    assert report.kernel and report.skipped == []
    assert fmt in report.summary()


def test_skip_lm_head_and_embeddings(tiny_dirs):
    model, _ = load_model(tiny_dirs["llama"], with_tokenizer=False)
    report = quantize_model(model, "int8", skip_lm_head=True, skip_embeddings=True)
    assert isinstance(model.lm_head, nn.Linear) and isinstance(model.embed_tokens, nn.Embedding)
    assert report.skipped == ["embed_tokens", "lm_head"]


def test_tied_int8_head_shares_codes_with_embedding(tiny_dirs):
    model, _ = load_model(tiny_dirs["qwen2"], with_tokenizer=False)
    assert model.lm_head.weight is model.embed_tokens.weight
    ref_bytes = model.embed_tokens.weight.numel()  # int8 codes of the [V, E] table, once
    report = quantize_model(model, "int8")
    assert isinstance(model.embed_tokens, Int8Embedding)
    assert model.embed_tokens.qweight.data_ptr() == model.lm_head.qweight.data_ptr()
    emb = next(layer for layer in report.layers if layer.kind == "embedding")
    assert emb.bytes_after >= ref_bytes
    # The shared table is counted once: total = quantized linears + the remaining (norm) parameters.
    linears = sum(layer.bytes_after for layer in report.layers if layer.kind == "linear")
    norms = sum(p.numel() * p.element_size() for p in model.parameters())
    assert report.weight_bytes_after == linears + norms


def test_tied_w8a8_head_is_w8a8_and_bytes_count_the_packed_weights(tiny_dirs):
    model, _ = load_model(tiny_dirs["qwen2"], with_tokenizer=False)
    vocab, hidden = model.embed_tokens.weight.shape
    report = quantize_model(model, "w8a8")
    assert isinstance(model.lm_head, W8A8Linear) and isinstance(model.embed_tokens, Int8Embedding)
    head = next(layer for layer in report.layers if layer.name == "lm_head")
    assert head.bytes_after == vocab * hidden + 4 * vocab  # int8 codes in fbgemm's pack + fp32 scales
    # the packed weights are not tensors: model_weight_bytes still counts them
    linears = sum(layer.bytes_after for layer in report.layers)
    norms = sum(p.numel() * p.element_size() for p in model.parameters())
    assert report.weight_bytes_after == model_weight_bytes(model) == linears + norms


def test_int8_embedding_lookup_matches_dequantized_rows(tiny_dirs):
    model, _ = load_model(tiny_dirs["llama"], with_tokenizer=False)
    emb = model.embed_tokens
    q = Int8Embedding.from_embedding(emb)
    ids = torch.tensor([[0, 5, 383, 5]])
    assert torch.allclose(q(ids), q.dequantized_weight()[ids], atol=1e-6)
    step = emb.weight.abs().amax(1) / 127
    assert bool(((q(ids) - emb(ids)).abs() <= step[ids][..., None] / 2 + 1e-6).all())


@pytest.mark.parametrize("fmt,max_kl", [("int8", 0.02), ("fp8", 0.05), ("int4", 0.5), ("w8a8", 0.05)])
def test_quantized_model_logits_stay_close(tiny_dirs, fmt, max_kl):
    model, _ = load_model(tiny_dirs["llama"], with_tokenizer=False)
    ids = torch.randint(0, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = torch.log_softmax(model(ids), -1)
        quantize_model(model, fmt)
        out = torch.log_softmax(model(ids), -1)
    kl = (ref.exp() * (ref - out)).sum(-1).mean().item()
    assert 0 < kl < max_kl


@pytest.mark.parametrize("fmt", FORMATS)
def test_generation_runs_after_quantization(tiny_dirs, fmt):
    model, tok = load_model(tiny_dirs["qwen2"])
    prompt = tok.encode("To be, or not to be")
    ref = list(generate_tokens(model, prompt, 12))
    apply_quantization(model, fmt)
    out = list(generate_tokens(model, prompt, 12))
    assert len(out) == 12 and all(0 <= t < model.config.vocab_size for t in out)
    if fmt == "int8":
        assert out[:2] == ref[:2]  # int8 moves logits by far less than the top-2 gap of the first steps
    # Sampled generation is reproducible on the quantized model too.
    a = list(generate_tokens(model, prompt, 8, temperature=1.0, seed=7))
    b = list(generate_tokens(model, prompt, 8, temperature=1.0, seed=7))
    assert a == b


def test_apply_quantization_none_is_a_noop(tiny_dirs):
    model, _ = load_model(tiny_dirs["llama"], with_tokenizer=False)
    assert apply_quantization(model, None) is None and apply_quantization(model, "none") is None
    assert not any(isinstance(m, QuantizedModule) for m in model.modules())


def test_unknown_format_and_bad_options_are_clear_errors(tiny_dirs):
    model, _ = load_model(tiny_dirs["llama"], with_tokenizer=False)
    with pytest.raises(FirstlightError, match="unknown quantization format 'int3'.*int4, int8"):
        quantize_model(model, "int3")
    with pytest.raises(QuantizationError, match="group_size must be one of"):
        get_format("int4", group_size=16)
    with pytest.raises(QuantizationError, match="takes no options"):
        get_format("int8", group_size=32)
    with pytest.raises(QuantizationError, match="act_scaling"):
        get_format("fp8", act_scaling="channel")
    with pytest.raises(QuantizationError, match="weight_bits must be one of"):
        get_format("w8a8", weight_bits=4)


def test_already_quantized_model_is_refused(tiny_dirs):
    model, _ = load_model(tiny_dirs["llama"], with_tokenizer=False)
    quantize_model(model, "int8")
    with pytest.raises(QuantizationError, match="already quantized"):
        quantize_model(model, "int4")


def test_bad_shape_names_the_layer_and_leaves_model_untouched(tiny_dirs):
    model, _ = load_model(tiny_dirs["llama"], with_tokenizer=False)
    # in_features 64 is not a multiple of 128: every layer fails; the error names the first one.
    with pytest.raises(QuantizationError, match=r"layer 'layers\.0\.self_attn\.qkv_proj'.*group_size 128.*\[32, 64\]"):
        quantize_model(model, "int4", group_size=128)
    assert not any(isinstance(m, QuantizedModule) for m in model.modules())


@pytest.mark.parametrize("fmt", FORMATS)
def test_unsupported_device_is_an_error_not_a_fallback(fmt):
    # fp8 emulation runs anywhere; its real FP8 GEMM (scaled_mm) does not.
    fmt_obj = get_format("fp8", kernel="scaled_mm") if fmt == "fp8" else get_format(fmt)
    with pytest.raises(QuantizationError, match="not supported on meta"):
        fmt_obj.kernel_path(torch.device("meta"), torch.float32)
    model = nn.Sequential(nn.Linear(64, 64)).to("meta")
    with pytest.raises(QuantizationError, match="not supported on meta"):
        quantize_model(model, fmt_obj)
