"""Bounded load on the server: streamed requests, some cancelled mid-stream, some malformed."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .server_helpers import running_server, wait_idle


async def _one(client: httpx.AsyncClient, kind: str, rng: random.Random) -> str:
    if kind == "malformed":
        body = rng.choice([
            {"model": "tiny", "prompt": "hi", "max_tokens": -3, "stream": True},
            {"model": "tiny", "prompt": "hi", "temperature": "hot", "stream": True},
            {"model": "tiny", "prompt": "hi" * 400, "max_tokens": 16, "stream": True},
            {"prompt": 5},
        ])
        r = await client.post("/v1/completions", json=body)
        return "400" if r.status_code == 400 else f"bad:{r.status_code}"
    body = {"model": "tiny", "prompt": f"The quick {rng.randint(0, 999)} brown", "max_tokens": rng.randint(4, 24),
            "stream": True, "ignore_eos": True, "temperature": rng.choice([0.0, 0.8])}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return f"bad:{r.status_code}"
        n = 0
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                return "done"
            if line.startswith("data: {"):
                n += 1
                if kind == "cancel" and n >= 2:
                    return "cancelled"  # leaving the block closes the connection mid-stream
    return "truncated"


async def _load(url: str, num_requests: int, concurrency: int, seed: int = 0) -> dict[str, int]:
    rng = random.Random(seed)
    kinds = ["cancel"] * (num_requests * 20 // 100) + ["malformed"] * (num_requests * 5 // 100)
    kinds += ["ok"] * (num_requests - len(kinds))
    rng.shuffle(kinds)
    sem = asyncio.Semaphore(concurrency)
    results: dict[str, int] = {}
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:

        async def run(kind: str) -> None:
            async with sem:
                res = await _one(client, kind, rng)
                key = f"{kind}:{res}"
                results[key] = results.get(key, 0) + 1

        await asyncio.wait_for(asyncio.gather(*(run(k) for k in kinds)), timeout=600)
    return results


def _check(results: dict[str, int], num_requests: int) -> None:
    assert not [k for k in results if "bad" in k or "truncated" in k], results
    assert results.get("ok:done", 0) == num_requests - num_requests * 25 // 100
    assert results.get("malformed:400", 0) == num_requests * 5 // 100


def _run_load(tiny, num_requests: int, concurrency: int) -> None:
    model, tok = tiny
    with running_server(model, tok, block_size=4, num_blocks=1024, max_model_len=256, max_num_seqs=32) as (url, eng):
        results = asyncio.run(_load(url, num_requests, concurrency))
        _check(results, num_requests)
        assert wait_idle(eng), "KV usage did not return to zero"
        assert eng.kv.usage == 0.0
        assert httpx.get(url + "/health").status_code == 200


def test_load_small(tiny) -> None:
    _run_load(tiny, num_requests=80, concurrency=16)


@pytest.mark.slow
def test_load_1000_at_64(tiny) -> None:
    _run_load(tiny, num_requests=1000, concurrency=64)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=10,
)
field_names = st.sampled_from([
    "model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stream", "stop",
    "seed", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "stream_options", "stop_token_ids", "min_tokens", "max_completion_tokens", "prompt_logprobs", "echo",
])


@pytest.fixture(scope="module")
def fuzz_server(tiny):
    model, tok = tiny
    with running_server(model, tok, block_size=4, num_blocks=256, max_model_len=64) as srv:
        yield srv


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
    body=st.dictionaries(field_names, json_values, max_size=6),
    base=st.booleans(),
)
def test_fuzzed_bodies_never_5xx(fuzz_server, path, body, base) -> None:
    url, engine = fuzz_server
    if base:  # start from a valid request so the fuzz reaches deeper validation
        valid = {"model": "tiny", "max_tokens": 3}
        valid.update({"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]})
        body = {**valid, **body}
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code < 500, (body, r.text)
    if r.status_code != 200:
        assert r.status_code == 400 and "error" in r.json()
