"""`--kv-cache-dtype int8|fp8`: the engine's paged cache stores K/V as codes + per-(token, head) scales;
`bf16|fp16`: as that 16-bit float.

The paged path must compute what the model-level quantized cache (quant/kv.py, the one the quality gate in
`eval ppl --quantization kv-int8` measures) computes, through block tables and chunked prefill; it must
really quantize (not match the fp32 engine exactly); and the same memory must hold more blocks."""

from __future__ import annotations

import pytest
import torch

from firstlight.engine.engine import EngineConfig, LLMEngine
from firstlight.engine.llm import LLM
from firstlight.engine.request import SamplingParams
from firstlight.errors import FirstlightError
from firstlight.quant.quality import kv_logits_fn

from .test_engine import prompts


@pytest.mark.parametrize("fmt", ["int8", "fp8", "bf16", "fp16"])
def test_paged_quantized_cache_matches_the_gated_model_level_cache(tiny, fmt) -> None:
    model, tok = tiny
    p = prompts(1, seed=7)[0] + prompts(1, seed=8)[0]  # long enough for several chunks and blocks
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    llm = LLM((model, tok), block_size=4, num_blocks=64, max_num_batched_tokens=8, kv_cache_dtype=fmt)
    out = llm.generate([p], sp)[0]
    with torch.no_grad():
        ref = torch.log_softmax(kv_logits_fn(model, fmt)(torch.tensor([p]))[0].float(), -1)
        plain = torch.log_softmax(model(torch.tensor([p]))[0].float(), -1)
    got = torch.tensor([out.prompt_logprobs[j].logprob for j in range(1, len(p))])
    want = torch.tensor([float(ref[j - 1, p[j]]) for j in range(1, len(p))])
    unquantized = torch.tensor([float(plain[j - 1, p[j]]) for j in range(1, len(p))])
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    assert (got - unquantized).abs().max() > 1e-6  # the cache really is quantized (or rounded)


def test_quantized_cache_holds_more_blocks_in_the_same_memory(tiny) -> None:
    model, tok = tiny
    budget = 1 << 20
    blocks = {d: LLMEngine(model, tok, EngineConfig(block_size=4, kv_cache_bytes=budget, kv_cache_dtype=d)).kv.num_blocks
              for d in ("auto", "int8", "fp8", "bf16", "fp16")}
    head_dim = model.config.head_dim
    ratio = 4 / (1 + 4 / head_dim)  # fp32 element vs one code byte + its share of an fp32 scale
    assert blocks["int8"] == blocks["fp8"]
    assert blocks["int8"] / blocks["auto"] == pytest.approx(ratio, rel=0.02)
    assert blocks["bf16"] == blocks["fp16"] == pytest.approx(2 * blocks["auto"], abs=1)
    eng = LLMEngine(model, tok, EngineConfig(block_size=4, num_blocks=16, kv_cache_dtype="int8"))
    assert eng.runner.k_pools[0].dtype == torch.int8 and eng.runner.scale_pools is not None


@pytest.mark.parametrize("kv", ["int8", "bf16"])
def test_greedy_decode_over_a_smaller_cache_stays_close(tiny, kv) -> None:
    model, tok = tiny
    ps = prompts(4, seed=3)
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
    ref = LLM((model, tok), block_size=4, num_blocks=256).generate(ps, sp)
    got = LLM((model, tok), block_size=4, num_blocks=256, kv_cache_dtype=kv).generate(ps, sp)
    same = sum(a == b for r, g in zip(ref, got, strict=True) for a, b in zip(r.output_token_ids, g.output_token_ids,
                                                                            strict=True))
    assert same >= 0.75 * 4 * 12  # random tiny weights have near-ties; most tokens agree


def test_unknown_kv_cache_dtype_is_a_named_error(tiny) -> None:
    model, tok = tiny
    with pytest.raises(FirstlightError, match="--kv-cache-dtype 'int4'"):
        LLMEngine(model, tok, EngineConfig(num_blocks=8, kv_cache_dtype="int4"))


def test_hybrid_model_quantizes_only_its_attention_layers(tiny_checkpoint) -> None:
    """Qwen3-Next: the int8 cache covers the one full-attention layer; the recurrent state slots keep their
    dtypes, their bytes still come out of the budget, and the paged path equals the model-level quantized
    cache (prompt logprobs through block tables and chunked prefill)."""
    from firstlight.engine.runner import ModelRunner
    from firstlight.models.loader import load_model

    model, tok = load_model(tiny_checkpoint("qwen3_next", seed=2))
    cfg = model.config
    budget = 1 << 20
    eng = LLMEngine(model, tok, EngineConfig(block_size=4, kv_cache_bytes=budget, kv_cache_dtype="int8",
                                             max_num_seqs=3, enable_prefix_caching=False))
    kv_layer = cfg.kv_layers[0]
    assert [p.numel() > 0 for p in eng.runner.k_pools] == [i in cfg.kv_layers for i in range(cfg.num_layers)]
    assert eng.runner.k_pools[kv_layer].dtype == torch.int8
    assert eng.runner.scale_pools is not None and eng.runner.scale_pools[0][0].numel() == 0
    assert {p.dtype for pools in eng.runner.state_pools.values() for p in pools} == {next(model.parameters()).dtype, torch.float32}
    state = 3 * ModelRunner.state_bytes_per_slot(model)
    per_block = 2 * len(cfg.kv_layers) * 4 * cfg.num_kv_heads * (cfg.head_dim + 4)  # codes + fp32 scale per head
    assert eng.kv.num_blocks == (budget - state) // per_block

    p = prompts(1, seed=7)[0] + prompts(1, seed=8)[0]
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    llm = LLM((model, tok), block_size=4, num_blocks=64, max_num_batched_tokens=8, kv_cache_dtype="int8")
    out = llm.generate([p], sp)[0]
    with torch.no_grad():
        ref = torch.log_softmax(kv_logits_fn(model, "int8")(torch.tensor([p]))[0].float(), -1)
    got = torch.tensor([out.prompt_logprobs[j].logprob for j in range(1, len(p))])
    want = torch.tensor([float(ref[j - 1, p[j]]) for j in range(1, len(p))])
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
