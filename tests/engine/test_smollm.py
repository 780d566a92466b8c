"""Engine vs the foundation `generate` path on the real SmolLM2-135M (slow: needs the pulled model)."""

from __future__ import annotations

import pytest
import torch

from firstlight.engine.engine import EngineConfig, LLMEngine
from firstlight.engine.request import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is", "def fibonacci(n):", "Once upon a time", "The meaning of life is",
    "In 1492, Columbus", "import numpy as np\n", "The quick brown fox", "Water boils at",
    "My favourite recipe for pancakes:", "Q: What is 2 + 2?\nA:", "The largest planet in the solar system",
    "Photosynthesis is the process", "To be, or not to be,", "SELECT * FROM users WHERE", "Dear Sir or Madam,",
    "The three laws of robotics are",
]


@pytest.fixture(scope="module")
def smollm():
    from firstlight.models.hub import is_pulled, model_path
    from firstlight.models.loader import load_model

    path = model_path("smollm2-135m")
    if not is_pulled(path):
        pytest.skip("smollm2-135m is not pulled (firstlight models pull smollm2-135m)")
    return load_model(path)


def test_engine_greedy_equals_generate_staggered(smollm) -> None:
    from firstlight.models.generate import generate_tokens

    torch.set_num_threads(2)
    model, tok = smollm
    n = 24
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    engine = LLMEngine(model, tok, EngineConfig(block_size=16, num_blocks=512, max_num_batched_tokens=64))
    ids = [tok.encode(p) for p in PROMPTS]
    done, rid_to_i, pending, step = {}, {}, list(enumerate(ids)), 0
    while pending or engine.has_unfinished():
        if pending and step % 3 == 0:  # staggered arrival: one new prompt every 3 steps
            i, p = pending.pop(0)
            rid_to_i[engine.add_request(p, params).request_id] = i
        for out in engine.step():
            if out.finished:
                done[rid_to_i[out.request_id]] = out.output_token_ids
        step += 1
    for i, p in enumerate(ids):
        ref = list(generate_tokens(model, p, n))
        assert done[i] == ref, f"prompt {i} {PROMPTS[i]!r}"


def test_preemption_same_tokens_real_model(smollm) -> None:
    torch.set_num_threads(2)
    model, tok = smollm
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    ids = [tok.encode(p) for p in PROMPTS[:6]]

    def run(num_blocks: int) -> tuple[list[list[int]], int]:
        engine = LLMEngine(model, tok, EngineConfig(block_size=4, num_blocks=num_blocks, enable_prefix_caching=False))
        reqs = [engine.add_request(p, params) for p in ids]
        while engine.has_unfinished():
            engine.step()
        return [r.output_token_ids for r in reqs], engine.scheduler.num_preemptions

    roomy, n0 = run(512)
    tight, n1 = run(40)
    assert n0 == 0 and n1 > 0
    assert tight == roomy
