"""Over HTTP: a speculating server streams multi-token chunks with the same greedy text, and
/metrics carries the acceptance counters."""

import json
import sys
from pathlib import Path

import httpx

from firstlight.engine.speculative.config import SpecConfig

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
from server_helpers import running_server  # noqa: E402


def _stream(url):
    body = {"model": "tiny", "prompt": [1, 40, 41, 42, 43, 40, 41], "max_tokens": 30, "temperature": 0,
            "ignore_eos": True, "stream": True}
    texts = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                texts.append(json.loads(line[6:])["choices"][0]["text"])
    return texts


def test_speculative_server_streams_same_text_and_reports_acceptance(tiny):
    model, tok = tiny
    with running_server(model, tok, num_blocks=64, block_size=4) as (url, _):
        plain = _stream(url)
    with running_server(model, tok, num_blocks=64, block_size=4, speculative=SpecConfig("ngram", num_spec_tokens=4)) as (url, engine):
        spec = _stream(url)
        metrics = httpx.get(url + "/metrics", timeout=10).text
    assert "".join(spec) == "".join(plain)
    assert len(spec) < len(plain)  # fewer chunks: some carried several tokens
    assert f"firstlight:spec_decode_num_accepted_tokens_total{{model_name=\"tiny\"}} {engine.spec.stats.num_accepted_tokens}" in metrics
    assert engine.spec.stats.num_accepted_tokens > 0
