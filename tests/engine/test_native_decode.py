"""The native decode step (engine/native_decode.py, firstlight::dense_decode): the engine's tokens and logprobs
the same with it on or off for every dense family feature (q/k/v bias, q/k norm, sliding windows) and every
weight format it takes; declined, with the reason, where it does not apply."""

from __future__ import annotations

import gc

import pytest
import torch

from firstlight import kernels
from firstlight.engine import native_decode
from firstlight.engine.engine import EngineConfig, LLMEngine
from firstlight.engine.native_decode import NativeDecode
from firstlight.engine.request import SamplingParams
from firstlight.models.loader import load_model
from firstlight.models.tiny import write_tiny_checkpoint
from firstlight.quant.f32 import F32Linear, use_f32_kernel
from firstlight.quant.model import quantize_model

from ..quant.test_int4_kernel import kernel_isa  # noqa: F401 - fixture
from .test_engine import prompts, run_staggered

PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=1)


def _engine(model, tok, native: bool, **config) -> LLMEngine:  # noqa: ANN001
    cfg = EngineConfig(block_size=4, num_blocks=128, max_num_batched_tokens=16, native_decode=native, **config)
    return LLMEngine(model, tok, cfg)


def _same_with_and_without(model, tok, rounded_activations: bool = False, num_prompts: int = 6,  # noqa: ANN001
                           **config) -> None:
    """rounded_activations (w4a8): each matmul rounds its input to int8, so a last-bit difference between the native
    glue and torch's (norms, rope) moves a value across a rounding boundary now and then (~1 in 40,000 values
    here), and a tiny random model's near-flat logits can then pick another token; there the check is that the
    paths agree up to such flips: the first tokens all equal, >= 80% of all tokens, logprobs within 0.05."""
    ps = prompts(num_prompts, seed=3)
    outs = {}
    for native in (True, False):
        engine = _engine(model, tok, native, **config)
        assert (engine.runner.native_decode is not None) is native, engine.runner.native_decode_declined
        outs[native] = run_staggered(engine, ps, PARAMS)
    agree = total = 0
    for i in range(len(ps)):
        on, off = outs[True][i].output_token_ids, outs[False][i].output_token_ids
        lp_on = [lp.logprob for lp in outs[True][i].logprobs]
        lp_off = [lp.logprob for lp in outs[False][i].logprobs]
        if not rounded_activations:
            assert on == off
            assert lp_on == pytest.approx(lp_off, abs=1e-4)
            continue
        assert on[0] == off[0]
        same = next((j for j, (a, b) in enumerate(zip(on, off, strict=True)) if a != b), len(on))  # the common prefix
        assert lp_on[:same] == pytest.approx(lp_off[:same], abs=0.05)
        agree, total = agree + sum(a == b for a, b in zip(on, off, strict=True)), total + len(on)
    assert agree >= 0.8 * total


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "gemma3_text"])
def test_families_same_tokens_and_logprobs(kernel_isa, family, tmp_path):  # noqa: F811
    """Staggered prompts: decode rows of different lengths; mistral's sliding window masks old keys; gemma3: (1 + w)
    norms, sublayer output norms, q/k norms, tanh-GELU, sliding and global layers with their own rope and pools."""
    overrides = {"sliding_window": 12} if family == "mistral" else {}
    model, tok = load_model(write_tiny_checkpoint(tmp_path / family, family=family, seed=1, **overrides))
    _same_with_and_without(model, tok)


@pytest.mark.parametrize("matmul", ["panels", "onednn"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_fp32_linears_as_served_same_tokens_and_logprobs(kernel_isa, matmul, family, tmp_path,  # noqa: F811
                                                         monkeypatch):
    """As the server loads fp32 (F32Linear): the native step's linears run on the prepared copies the eager ones
    use, f32_pack's panels (an AVX-512 build) or oneDNN's reordered weights above its row limit (12 decode rows);
    qwen2's q/k/v bias through each."""
    if matmul == "onednn":
        monkeypatch.setattr(kernels, "F32_PANEL_ISAS", ())
    elif not kernels.f32_panels():
        pytest.skip("not an AVX-512 build of the kernels: fp32 linears do not run on panels here")
    model, tok = load_model(write_tiny_checkpoint(tmp_path / "m", family=family, seed=4))
    use_f32_kernel(model)
    kinds = {native_decode._linear(m)[0] for m in model.modules() if isinstance(m, F32Linear)}
    assert kinds == {native_decode.F32_PANELS if matmul == "panels" else native_decode.F32}
    _same_with_and_without(model, tok, num_prompts=12)


@pytest.mark.parametrize("fmt", ["int4", "int8", "w4a8"])
def test_formats_same_tokens_and_logprobs(kernel_isa, fmt, tmp_path):  # noqa: F811
    model, tok = load_model(write_tiny_checkpoint(tmp_path / "m", family="llama", seed=2))
    quantize_model(model, fmt)
    _same_with_and_without(model, tok, rounded_activations=fmt == "w4a8")


@pytest.mark.parametrize("kv", ["bf16", "fp16"])
def test_16_bit_cache_same_tokens_and_logprobs(kernel_isa, kv, tmp_path):  # noqa: F811
    """--kv-cache-dtype bf16 / fp16: the native step rounds the new K/V into the pools as torch's store does and its
    attention reads them in place; sliding and global layers (gemma3)."""
    model, tok = load_model(write_tiny_checkpoint(tmp_path / "m", family="gemma3_text", seed=1))
    _same_with_and_without(model, tok, kv_cache_dtype=kv)


def test_declines_what_it_does_not_run(kernel_isa, tmp_path):  # noqa: F811
    moe, tok = load_model(write_tiny_checkpoint(tmp_path / "g", family="qwen3_moe", seed=1))
    engine = _engine(moe, tok, True)
    assert engine.runner.native_decode is None and "decoder" in engine.runner.native_decode_declined
    model, tok = load_model(write_tiny_checkpoint(tmp_path / "l", family="llama", seed=1))
    engine = _engine(model, tok, True, kv_cache_dtype="int8")  # quantized pools: no paged attention, no native step
    assert engine.runner.native_decode is None
    done = run_staggered(engine, prompts(2), PARAMS)
    assert all(len(o.output_token_ids) == 10 for o in done.values())
    quantize_model(model, "w8a8")  # fbgemm's linear: not a kernel of ours
    engine = _engine(model, tok, True)
    assert engine.runner.native_decode is None and "W8A8Linear" in engine.runner.native_decode_declined


def test_a_freed_plan_is_a_clear_error(kernel_isa, tmp_path):  # noqa: F811
    model, _ = load_model(write_tiny_checkpoint(tmp_path / "l", family="llama", seed=1))
    cfg = model.config
    pools = [torch.zeros(8, cfg.num_kv_heads, cfg.head_dim) for _ in range(cfg.num_layers)]
    plan, why = NativeDecode.build(model, pools, pools)
    assert plan is not None, why
    handle = plan.handle
    del plan
    gc.collect()
    with pytest.raises(RuntimeError, match="no plan"):
        torch.ops.firstlight.dense_decode(handle, torch.zeros(1, cfg.hidden_size), torch.zeros(1, dtype=torch.long),
                                          [], [], [], [], [], [])


@pytest.mark.parametrize("family,rope,kinds", [
    ("gemma3_text", None, {"default", "linear"}),  # local and global layers, each with its own table
    ("llama", {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64}, {"yarn"}),
    ("llama", {"rope_type": "dynamic", "factor": 2.0}, {"dynamic"})])
def test_rope_rows_looked_up_as_the_model_builds_them(kernel_isa, family, rope, kinds, tmp_path):  # noqa: F811
    """The native step looks each row's cos / sin up in tables it keeps per KV group (grown as positions pass
    their length); they are the model's own rope_tables at those positions, for both of Gemma 3's groups and
    YaRN's scaled tables; dynamic NTK (scaled by each row's length) is never cached."""
    overrides = {"rope_scaling": rope} if rope else {}
    model, _ = load_model(write_tiny_checkpoint(tmp_path / family, family=family, seed=1, **overrides))
    cfg = model.config
    assert {r.kind for r in cfg.rope.values()} == kinds
    pools = [torch.zeros(8, cfg.num_kv_heads, cfg.head_dim) for _ in range(cfg.num_layers)]
    plan, why = NativeDecode.build(model, pools, pools)
    assert plan is not None, why
    assert plan._cached_rope is ("dynamic" not in kinds)
    for positions in ([[3], [0], [255]], [[256], [7]], [[1000], [2], [600]]):  # the last two grow the tables
        pos = torch.tensor(positions)
        cos, sin = plan._rope(pos, torch.float32)
        ref = model.rope_tables(pos, torch.float32)
        for t, c, s in zip(plan.kv_types, cos, sin, strict=True):
            assert torch.allclose(c.reshape(len(pos), -1), ref[t][0].reshape(len(pos), -1), atol=1e-6, rtol=0)
            assert torch.allclose(s.reshape(len(pos), -1), ref[t][1].reshape(len(pos), -1), atol=1e-6, rtol=0)
    assert plan._rope_len >= 1001 or not plan._cached_rope
