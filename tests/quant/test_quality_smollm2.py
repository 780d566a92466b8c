"""Quality gates on SmolLM2-135M (slow: needs the pulled model and the `shakespeare` corpus; several
minutes on 2 cores the first time, while GPTQ runs; its results are cached under FIRSTLIGHT_HOME).

The goals of issue 7: perplexity ratio vs fp32 on 2048 tokens of the hamlet sample, int8 <= 1.005,
FP8 <= 1.01, int4 <= 1.05; and of issue 15: w8a8 <= 1.01. Each format runs its default method (calibrated.DEFAULT_METHODS): GPTQ
for int8 and fp8 (block 32), calibrated on `shakespeare` without Hamlet; round-to-nearest for int4.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

FORMATS = ("int8", "fp8", "int4", "w8a8")
KL_CEILINGS = {"int8": 0.005, "fp8": 0.02, "int4": 0.005, "w8a8": 0.012}  # a little above the measured mean KL
# w8a8 keeps a head of its own (w8a8, next to the int8 embedding) and fp32 exact channels: 3.2x, not 3.5x
MIN_COMPRESSION = {"int8": 3.5, "fp8": 3.5, "int4": 3.5, "w8a8": 3.0}


@pytest.fixture(scope="module")
def gate():
    from firstlight.errors import FirstlightError
    from firstlight.models import hub
    from firstlight.models.loader import load_model
    from firstlight.quant.calibrated import DEFAULT_METHODS, calibration_token_ids, default_cache_dir
    from firstlight.quant.quality import corpus_ids, evaluate_formats

    try:
        path = hub.resolve("smollm2-135m", auto_pull=False)
    except Exception as e:  # noqa: BLE001 - any reason the model is not here
        pytest.skip(f"smollm2-135m not pulled: {e}")
    model, tok = load_model(path)
    try:
        cal = calibration_token_ids(tok, "shakespeare")
    except FirstlightError as e:
        pytest.skip(f"shakespeare corpus unavailable: {e}")
    ids = corpus_ids(tok, "hamlet-sample", 2048)
    opts = {}
    for f in FORMATS:
        opts[f] = {"method": DEFAULT_METHODS[f]}
        if DEFAULT_METHODS[f] == "gptq":
            opts[f].update(calibration_ids=cal, calibration_name="shakespeare", cache_dir=default_cache_dir())
    base, results = evaluate_formats(model, ids, list(FORMATS), quant_opts=opts)
    assert 20 < base.perplexity < 60  # a 135M model on Shakespeare: sanity of the fp32 baseline
    return base, {r.format: r for r in results}


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_smollm2_meets_the_issue_goal(gate, fmt):
    base, by_format = gate
    r = by_format[fmt]
    assert r.goal is not None and r.ppl_ratio <= r.goal, (fmt, r.ppl_ratio, r.goal)
    assert r.ppl_ratio > 0.99  # int4 recovers the Q4_1 source grid, so ~1.0 (0.9995 measured), not better
    assert 0.0 < r.mean_kl <= KL_CEILINGS[fmt], (fmt, r.mean_kl)
    assert r.weight_bytes < base.weight_bytes / MIN_COMPRESSION[fmt]
    assert r.method == {"int8": "gptq", "fp8": "gptq", "int4": "rtn", "w8a8": "gptq"}[fmt]


def test_kl_orders_the_formats(gate):
    by_format = gate[1]
    assert by_format["int4"].mean_kl < by_format["fp8"].mean_kl  # int4 is exact on the layers; fp8 rounds x too
    assert by_format["int8"].mean_kl < by_format["fp8"].mean_kl
