"""Quality gates on SmolLM2-135M (slow: needs the pulled model, a few minutes on 2 cores).

The goals of issue 7 are int8 <= 1.005, FP8 <= 1.01, int4 <= 1.05 in perplexity ratio vs fp32. What
this asserts is what the formats reach today (docs/QUANT.md has the figures): a ceiling a little
above the measured ratio, so a regression fails, and an ordering int8 < fp8, int8 < int4.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

# Measured ratios (2048 tokens of the hamlet sample) are in docs/QUANT.md; these are regression ceilings.
CEILINGS = {"int8": 1.015, "fp8": 1.07, "int4": 1.08}
KL_CEILINGS = {"int8": 0.01, "fp8": 0.08, "int4": 0.08}


def test_quantized_smollm2_perplexity_and_kl():
    from firstlight.engine.quant.quality import corpus_ids, evaluate_formats
    from firstlight.models import hub
    from firstlight.models.loader import load_model

    try:
        path = hub.resolve("smollm2-135m", auto_pull=False)
    except Exception as e:  # noqa: BLE001 - any reason the model is not here
        pytest.skip(f"smollm2-135m not pulled: {e}")
    model, tok = load_model(path)
    ids = corpus_ids(tok, "hamlet-sample", 2048)
    base, results = evaluate_formats(model, ids, list(CEILINGS))
    assert 20 < base.perplexity < 60  # a 135M model on Shakespeare: sanity of the fp32 baseline
    by_format = {r.format: r for r in results}
    for fmt, r in by_format.items():
        assert 1.0 < r.ppl_ratio <= CEILINGS[fmt], (fmt, r.ppl_ratio)
        assert 0.0 < r.mean_kl <= KL_CEILINGS[fmt], (fmt, r.mean_kl)
        assert r.weight_bytes < base.weight_bytes / 3
    assert by_format["int8"].mean_kl < by_format["fp8"].mean_kl
    assert by_format["int8"].mean_kl < by_format["int4"].mean_kl
