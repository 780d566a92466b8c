"""The engine's attention kernels (engine/runner.py PagedKVCache.attend): decode over the paged pools in place
(firstlight::paged_decode_attention) and prefill chunks over the gathered keys (firstlight::attention), each
equal to SDPA for every head grouping, head size, mask and padding; the engine's tokens and logits the same
with them on or off; declined where they do not apply (quantized KV)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from firstlight import kernels
from firstlight.engine.engine import EngineConfig, LLMEngine
from firstlight.engine.request import SamplingParams
from firstlight.quant.kv import KV_CAST_FORMATS

from ..quant.test_int4_kernel import kernel_isa  # noqa: F401 - fixture
from .test_engine import GREEDY, prompts, run_staggered


def _reference(q, k_pool, v_pool, slots, mask, scale):  # noqa: ANN001, ANN202
    b, h, d = q.shape
    hkv = k_pool.shape[1]
    k = k_pool[slots].transpose(1, 2).double()  # [B, Hkv, L, D]
    v = v_pool[slots].transpose(1, 2).double()
    m = None if mask is None else mask[:, None, None, :]
    out = F.scaled_dot_product_attention(q[:, :, None].double(), k, v, attn_mask=m, scale=scale,
                                         enable_gqa=hkv != h)[:, :, 0]
    return out.float()


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 64), (9, 3, 64), (8, 1, 72), (16, 2, 20), (6, 3, 128),
                                                     (12, 2, 48), (5, 1, 16), (3, 3, 8)])
@pytest.mark.parametrize("masked", [False, True])
def test_equals_gather_and_sdpa(kernel_isa, heads, kv_heads, head_dim, masked):  # noqa: F811
    torch.manual_seed(heads * 100 + head_dim)
    batch, keys, nslots = 5, 37, 400
    k_pool, v_pool = torch.randn(nslots, kv_heads, head_dim), torch.randn(nslots, kv_heads, head_dim)
    slots = torch.stack([torch.randperm(nslots)[:keys] for _ in range(batch)])
    q = torch.randn(batch, heads, head_dim)
    mask = torch.rand(batch, keys) < 0.7 if masked else None
    if masked:
        mask[:, 0] = True  # every row sees one key at least (a row that sees none: next test)
    got = kernels.paged_decode_attention(q, k_pool, v_pool, slots, mask, head_dim ** -0.5)
    ref = _reference(q, k_pool, v_pool, slots, mask, head_dim ** -0.5)
    assert got.shape == q.shape
    assert torch.allclose(got, ref, atol=2e-6, rtol=1e-5), (got - ref).abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 1, 72), (5, 1, 16), (3, 3, 8)])
def test_16_bit_pools_read_as_they_are(kernel_isa, dtype, heads, kv_heads, head_dim):  # noqa: F811
    """bf16 / fp16 pools (--kv-cache-dtype): the kernel widens each element as it loads it; the result is the
    fp32 kernel's on the same values widened first (and differs from the unrounded pools')."""
    torch.manual_seed(head_dim)
    batch, keys, nslots = 4, 29, 200
    k32, v32 = torch.randn(nslots, kv_heads, head_dim), torch.randn(nslots, kv_heads, head_dim)
    k_pool, v_pool = k32.to(dtype), v32.to(dtype)
    slots = torch.stack([torch.randperm(nslots)[:keys] for _ in range(batch)])
    q, mask = torch.randn(batch, heads, head_dim), torch.rand(batch, keys) < 0.8
    mask[:, 0] = True
    got = kernels.paged_decode_attention(q, k_pool, v_pool, slots, mask, head_dim ** -0.5)
    ref = _reference(q, k_pool.float(), v_pool.float(), slots, mask, head_dim ** -0.5)
    assert torch.allclose(got, ref, atol=2e-6, rtol=1e-5), (got - ref).abs().max()
    assert (got - _reference(q, k32, v32, slots, mask, head_dim ** -0.5)).abs().max() > 1e-5
    with pytest.raises(RuntimeError, match="fp32, bf16 or fp16"):  # K and V of two dtypes
        kernels.paged_decode_attention(q, k_pool, v32, slots, mask, 1.0)


def test_a_row_that_sees_no_key_gets_zeros(kernel_isa):  # noqa: F811
    torch.manual_seed(0)
    k_pool = v_pool = torch.randn(50, 2, 16)
    slots = torch.randint(0, 50, (3, 8))
    mask = torch.ones(3, 8, dtype=torch.bool)
    mask[1] = False
    out = kernels.paged_decode_attention(torch.randn(3, 4, 16), k_pool, v_pool, slots, mask, 0.25)
    assert torch.isfinite(out).all() and out[1].abs().max() == 0 and out[0].abs().max() > 0


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
@pytest.mark.parametrize("batch,heads,kv_heads", [(1, 9, 3), (1, 8, 1), (2, 4, 2)])
def test_keys_split_across_threads(kernel_isa, threads, batch, heads, kv_heads):  # noqa: F811
    """Fewer (row, KV head) pairs than two per thread: each pair's keys run in chunks on the threads and their
    partial sums are merged (flash-decoding); the result is SDPA's whatever the split, with a chunk that sees
    no key (a masked run), a row that sees a few keys only, and a row that sees none."""
    torch.manual_seed(threads * 10 + heads)
    keys, nslots, head_dim = 300, 1000, 64
    k_pool, v_pool = torch.randn(nslots, kv_heads, head_dim), torch.randn(nslots, kv_heads, head_dim)
    slots = torch.stack([torch.randperm(nslots)[:keys] for _ in range(batch)])
    q = torch.randn(batch, heads, head_dim) * 3  # peaked softmaxes: the merge's rescaling matters
    mask = torch.rand(batch, keys) < 0.9
    mask[0, 40:220] = False  # whole chunks of row 0 see nothing
    if batch > 1:
        mask[1] = False
        mask[1, [5, 290]] = True  # two keys, in the first and last chunks
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = kernels.paged_decode_attention(q, k_pool, v_pool, slots, mask, head_dim ** -0.5)
        mask_none = mask.clone()
        mask_none[0] = False
        empty = kernels.paged_decode_attention(q, k_pool, v_pool, slots, mask_none, head_dim ** -0.5)
    finally:
        torch.set_num_threads(before)
    ref = _reference(q, k_pool, v_pool, slots, mask, head_dim ** -0.5)
    assert torch.allclose(got, ref, atol=2e-6, rtol=1e-5), (got - ref).abs().max()
    assert empty[0].abs().max() == 0 and torch.isfinite(empty).all()


def test_rejects_mismatched_shapes(kernel_isa):  # noqa: F811
    pool = torch.randn(10, 3, 16)
    with pytest.raises(RuntimeError, match="does not match pools"):
        kernels.paged_decode_attention(torch.randn(2, 4, 16), pool, pool, torch.zeros(2, 3, dtype=torch.long),
                                           None, 1.0)


def _sdpa64(q, k, v, mask, causal, scale):  # noqa: ANN001, ANN202
    """SDPA in fp64 with the kernel's conventions: causal queries are the last S of the L positions, and a query
    that sees no key gets zeros."""
    s, length = q.shape[2], k.shape[2]
    if mask is None and causal:
        mask = torch.ones(s, length, dtype=torch.bool).tril(length - s).expand(q.shape[0], s, length)
    m = None if mask is None else mask.reshape(q.shape[0], 1, s, length)
    out = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=m, scale=scale,
                                         enable_gqa=k.shape[1] != q.shape[1])
    if m is not None:
        out = out.masked_fill(~m.any(-1, keepdim=True), 0.0)
    return out.float()


def _qkv(batch, heads, kv_heads, seq, keys, head_dim):  # noqa: ANN001, ANN202
    """q [B, H, S, D], k, v [B, Hkv, L, D] as the model and the cache make them: views of [B, S, H, D] storage."""
    q = torch.randn(batch, seq, heads, head_dim).transpose(1, 2)
    k = torch.randn(batch, keys, kv_heads, head_dim).transpose(1, 2)
    v = torch.randn(batch, keys, kv_heads, head_dim).transpose(1, 2)
    return q, k, v


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 16), (8, 1, 72), (16, 2, 20), (6, 3, 128),
                                                     (12, 2, 48), (3, 3, 8)])
@pytest.mark.parametrize("seq,keys", [(7, 7), (37, 37), (5, 40), (1, 9), (70, 130)])
def test_prefill_attention_equals_sdpa(kernel_isa, heads, kv_heads, head_dim, seq, keys):  # noqa: F811
    """Causal (the queries the last `seq` positions), a boolean mask (random; a sliding window; rows that see
    nothing) and no mask, on strided q, k, v as the model passes them."""
    torch.manual_seed(heads * 1000 + head_dim * 10 + seq)
    batch, scale = 3, head_dim ** -0.5
    q, k, v = _qkv(batch, heads, kv_heads, seq, keys, head_dim)
    pos = torch.arange(keys - seq, keys)[:, None]
    window = (torch.arange(keys) <= pos) & (pos - torch.arange(keys) < 4)
    sparse = torch.rand(batch, seq, keys) < 0.4
    sparse[:, seq // 2] = False  # a query that sees no key
    cases = [(None, True), (None, False), (window.expand(batch, seq, keys), False), (sparse, False),
             (window[None, None].expand(batch, 1, seq, keys), False)]  # the model's [B, 1, S, L]
    for mask, causal in cases:
        got = kernels.attention(q, k, v, mask, causal, scale)
        ref = _sdpa64(q, k, v, mask, causal, scale)
        assert got.shape == (batch, heads, seq, head_dim)
        assert torch.allclose(got, ref, atol=3e-6, rtol=1e-5), (mask is None, causal, (got - ref).abs().max())


def test_prefill_attention_rejects_bad_shapes(kernel_isa):  # noqa: F811
    q, k, v = _qkv(2, 4, 2, 5, 5, 16)
    with pytest.raises(RuntimeError, match="does not match"):
        kernels.attention(q, k[:, :, :, :8], v, None, True, 1.0)
    with pytest.raises(RuntimeError, match="mask must be"):
        kernels.attention(q, k, v, torch.ones(2, 5, 4, dtype=torch.bool), False, 1.0)
    with pytest.raises(RuntimeError, match="fp32"):
        kernels.attention(q.double(), k, v, None, True, 1.0)


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_engine_tokens_and_logprobs_same_with_and_without(kernel_isa, family, tmp_path):  # noqa: F811
    """Staggered prompts (decode rows of different lengths, padded keys), prefill chunks with earlier context
(masked) and without (causal), sliding-window layers (gemma3)."""
    from firstlight.models.loader import load_model
    from firstlight.models.tiny import write_tiny_checkpoint

    model, tok = load_model(write_tiny_checkpoint(tmp_path / family, family=family, seed=1))
    ps = prompts(6, seed=3)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=1)
    outs = {}
    for paged in (True, False):
        engine = LLMEngine(model, tok, EngineConfig(block_size=4, num_blocks=128, max_num_batched_tokens=16,
                                                    paged_attention=paged))
        assert engine.runner.paged_attention is paged
        outs[paged] = run_staggered(engine, ps, params)
    for i in range(len(ps)):
        assert outs[True][i].output_token_ids == outs[False][i].output_token_ids
        lp_on = [lp.logprob for lp in outs[True][i].logprobs]
        assert lp_on == pytest.approx([lp.logprob for lp in outs[False][i].logprobs], abs=1e-4)


@pytest.mark.parametrize("kv", ["bf16", "fp16"])
def test_16_bit_cache_same_tokens_and_logprobs_with_and_without(kernel_isa, kv, tmp_path):  # noqa: F811
    """A 16-bit cache: the kernels read the pools in place, the module path gathers and widens; both see the same
    rounded K/V."""
    from firstlight.models.loader import load_model
    from firstlight.models.tiny import write_tiny_checkpoint

    model, tok = load_model(write_tiny_checkpoint(tmp_path / "m", family="gemma3_text", seed=1))
    ps = prompts(6, seed=3)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=1)
    outs = {}
    for paged in (True, False):
        engine = LLMEngine(model, tok, EngineConfig(block_size=4, num_blocks=128, max_num_batched_tokens=16,
                                                    paged_attention=paged, kv_cache_dtype=kv, native_decode=False))
        assert engine.runner.paged_attention is paged and engine.runner.k_pools[0].dtype == KV_CAST_FORMATS[kv]
        outs[paged] = run_staggered(engine, ps, params)
    for i in range(len(ps)):
        assert outs[True][i].output_token_ids == outs[False][i].output_token_ids
        lp_on = [lp.logprob for lp in outs[True][i].logprobs]
        assert lp_on == pytest.approx([lp.logprob for lp in outs[False][i].logprobs], abs=1e-4)


def test_quantized_kv_declines_and_still_decodes(kernel_isa, tiny):  # noqa: F811
    model, tok = tiny
    engine = LLMEngine(model, tok, EngineConfig(block_size=4, num_blocks=64, kv_cache_dtype="int8"))
    assert engine.runner.paged_attention is False  # int8 pools: the gather path dequantizes
    done = run_staggered(engine, prompts(2), GREEDY)
    assert all(len(o.output_token_ids) == 10 for o in done.values())
