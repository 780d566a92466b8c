"""Quantized KV cache: round-trip error bound of quantize/dequantize, the cache contract, and a
model decoding over it stays close to the fp32 cache."""

from __future__ import annotations

import pytest
import torch

from firstlight.models.kv_cache import ContiguousKVCache
from firstlight.models.loader import load_model
from firstlight.quant import (
    QuantizationError,
    QuantizedKVCache,
    dequantize_kv,
    make_kv_cache,
    quantize_kv,
)


@pytest.mark.parametrize("fmt,rel_step", [("int8", 1 / 127 / 2), ("fp8", 2**-4)])
def test_round_trip_error_bound(fmt, rel_step):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 17, 64) * torch.logspace(-3, 2, 17)[:, None]  # heads of very different scales
    q, scale = quantize_kv(x, fmt)
    assert q.shape == x.shape and scale.shape == (2, 3, 17, 1) and q.element_size() == 1
    back = dequantize_kv(q, scale, torch.float32)
    amax = x.abs().amax(-1, keepdim=True)
    if fmt == "int8":
        bound = amax * rel_step + 1e-7  # half a step of amax/127
    else:
        bound = x.abs() * rel_step + amax * 2**-9 / 448 * 2 + 1e-7  # relative half-ulp (+ subnormals)
    assert bool(((back - x).abs() <= bound).all())
    # The largest value of each (token, head) maps to the top code: it comes back unrounded.
    assert torch.allclose(back.abs().amax(-1), amax[..., 0], rtol=1e-6)


def test_zeros_and_unknown_format():
    q, scale = quantize_kv(torch.zeros(1, 1, 2, 8), "int8")
    assert torch.equal(dequantize_kv(q, scale, torch.float32), torch.zeros(1, 1, 2, 8))
    with pytest.raises(QuantizationError, match="KV-cache format 'int4'"):
        quantize_kv(torch.zeros(1, 4), "int4")


def test_cache_contract_matches_contiguous_cache():
    torch.manual_seed(1)
    plain = ContiguousKVCache(2, 1, 2, 16, 10)
    quant = QuantizedKVCache(2, 1, 2, 16, 10, fmt="int8")
    for new in (4, 1, 1):
        pos = torch.arange(plain.length, plain.length + new).unsqueeze(0)
        assert torch.equal(plain.begin(pos), quant.begin(pos))
        for layer in range(2):
            k, v = torch.randn(1, 2, new, 16), torch.randn(1, 2, new, 16)
            pk, pv = plain.update(layer, k, v)
            qk, qv = quant.update(layer, k, v)
            assert qk.shape == pk.shape and qk.dtype == torch.float32
            assert torch.allclose(qk, pk, atol=0.03) and torch.allclose(qv, pv, atol=0.03)
        plain.end()
        quant.end()
    assert quant.length == 6
    with pytest.raises(ValueError, match="KV cache full"):
        quant.begin(torch.arange(6, 11).unsqueeze(0))
    fp32_bytes = sum(t.numel() * t.element_size() for t in plain.k + plain.v)
    assert quant.storage_bytes() == fp32_bytes // 4 + fp32_bytes // 16  # codes + one fp32 scale per 16 values


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_decoding_over_quantized_cache_stays_close(tiny_dirs, fmt):
    model, _ = load_model(tiny_dirs["llama"], with_tokenizer=False)
    cfg = model.config
    ids = torch.randint(0, cfg.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    args = (cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim, 24)
    outs = {}
    for kind in ("none", fmt):
        cache = make_kv_cache(kind, *args)
        with torch.no_grad():
            first = model(ids[:, :16], torch.arange(16).unsqueeze(0), cache)[:, -1]
            steps = [model(ids[:, p : p + 1], torch.tensor([[p]]), cache)[:, -1] for p in range(16, 24)]
        outs[kind] = torch.log_softmax(torch.cat([first, *steps]), -1)
    assert isinstance(make_kv_cache(fmt, *args), QuantizedKVCache)
    ref, out = outs["none"], outs[fmt]
    kl = (ref.exp() * (ref - out)).sum(-1).mean().item()
    assert 0 < kl < (0.01 if fmt == "int8" else 0.05)
