"""Per-request speculation over HTTP: `num_speculative_tokens` in completions and chat bodies."""

from __future__ import annotations

import httpx
import pytest

from firstlight.engine.speculative.config import SpecConfig

from .server_helpers import running_server, wait_idle
from .test_engine import full_forward_greedy

PROMPT = [5, 6, 7, 8, 9] * 8  # repetitive: the n-gram proposer always finds a match to propose from


@pytest.fixture(scope="module")
def spec_server(tiny):
    model, tok = tiny
    spec = SpecConfig("ngram", num_spec_tokens=4)
    with running_server(model, tok, block_size=4, num_blocks=256, max_model_len=128, speculative=spec) as s:
        yield s


def _complete(url: str, **body: object) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 12, "temperature": 0,
                                                     "ignore_eos": True, **body}, timeout=60)


def test_per_request_k_bounds_drafts_and_keeps_greedy_output(spec_server, tiny) -> None:
    url, engine = spec_server
    model, tok = tiny
    expected = tok.decode(full_forward_greedy(model, PROMPT, 12), skip_special_tokens=True)
    stats = engine.spec.stats
    for k in (0, 1, 2, None):
        drafts, tokens = stats.num_drafts, stats.num_draft_tokens
        r = _complete(url, num_speculative_tokens=k)
        assert r.status_code == 200, r.text
        assert wait_idle(engine)
        num_drafts, num_tokens = stats.num_drafts - drafts, stats.num_draft_tokens - tokens
        if k == 0:
            assert num_drafts == 0 and num_tokens == 0  # speculation off for this request
        else:
            assert num_drafts > 0
            assert num_tokens <= num_drafts * (k or 4)  # never more than its own k (or the server's) per step
        # lossless: the greedy text is plain greedy decoding's, whatever k
        assert r.json()["choices"][0]["text"] == expected
        assert r.json()["usage"]["completion_tokens"] == 12


def test_chat_accepts_per_request_k(spec_server) -> None:
    url, engine = spec_server
    body = {"messages": [{"role": "user", "content": "abc abc abc abc"}], "max_tokens": 6, "temperature": 0,
            "num_speculative_tokens": 3}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert wait_idle(engine)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("k,fragment", [(5, "exceeds this server's --num-spec-tokens 4"), (-1, "greater than or equal")])
def test_out_of_range_k_is_400(spec_server, path, k, fragment) -> None:
    url, _ = spec_server
    body = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(url + path, json={**body, "max_tokens": 4, "num_speculative_tokens": k}, timeout=60)
    assert r.status_code == 400
    err = r.json()["error"]
    assert fragment in err["message"] and err["type"] == "invalid_request_error"


def test_server_without_speculation(tiny) -> None:
    model, tok = tiny
    with running_server(model, tok, block_size=4, num_blocks=128, max_model_len=128) as (url, engine):
        r = _complete(url, num_speculative_tokens=2)
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["code"] == "speculation_not_enabled" and err["param"] == "num_speculative_tokens"
        assert "--speculative" in err["message"]
        assert _complete(url, num_speculative_tokens=0).status_code == 200  # 0 = off: always fine
        assert wait_idle(engine)
