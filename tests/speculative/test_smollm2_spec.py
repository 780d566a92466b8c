"""SmolLM2-135M fp32, 16 prompts at once through the engine: greedy output with each proposer is
token-for-token the output without speculation. Needs the pulled model (FIRSTLIGHT_HOME)."""

import pytest

from firstlight.engine.engine import EngineConfig, LLMEngine
from firstlight.engine.request import SamplingParams
from firstlight.engine.speculative.config import SpecConfig
from firstlight.engine.speculative.medusa import default_heads_path

pytestmark = pytest.mark.slow

TEXTS = [
    "The capital of France is", "def fibonacci(n):", "Once upon a time", "import numpy as np\n",
    "The quick brown fox", "To be, or not to be,", "class Stack:\n    def", "Water boils at",
    "for i in range(10):", "The meaning of life is", "SELECT * FROM", "My favourite food is",
    "def is_prime(n):", "In 1492, Columbus", "The sun rises in the", "Dear Sir or Madam,",
]


@pytest.fixture(scope="module")
def smollm2():
    from firstlight.models.hub import is_pulled, model_path
    from firstlight.models.loader import load_model

    if not is_pulled(model_path("smollm2-135m")):
        pytest.skip("smollm2-135m is not pulled (firstlight models pull smollm2-135m)")
    model, tok = load_model(model_path("smollm2-135m"))
    return model.eval(), tok


def _generate(model, tok, spec):
    engine = LLMEngine(model, tok, EngineConfig(speculative=spec, kv_cache_bytes=256 << 20))
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(t, params).request_id for t in TEXTS]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.output_token_ids
    return [done[i] for i in ids], engine


@pytest.fixture(scope="module")
def reference(smollm2):
    return _generate(*smollm2, None)[0]


@pytest.mark.parametrize("method", ["ngram", "draft", "heads"])
def test_greedy_identical_with_speculation(smollm2, reference, method):
    from firstlight.models.hub import model_path

    model, tok = smollm2
    heads = default_heads_path(model_path("smollm2-135m"))
    if method == "heads" and not heads.is_file():
        pytest.skip(f"no heads trained at {heads} (firstlight train heads --model smollm2-135m)")
    want = reference
    got, engine = _generate(model, tok, SpecConfig(method, num_spec_tokens=4, draft_layers=8, heads_path=str(heads)))
    assert got == want
    assert engine.spec.stats.num_drafts > 0
