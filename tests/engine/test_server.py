from __future__ import annotations

import json
import socket
import time

import httpx
import openai
import pytest

from .server_helpers import running_server, wait_idle
from .test_engine import full_forward_greedy


@pytest.fixture(scope="module")
def server(tiny):
    model, tok = tiny
    with running_server(model, tok, block_size=4, num_blocks=512, max_model_len=256) as (url, engine):
        yield url, engine


@pytest.fixture
def client(server):
    url, _ = server
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)


def test_models_health_metrics(server, client) -> None:
    url, _ = server
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(url + "/health").status_code == 200
    text = httpx.get(url + "/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
                 "generation_tokens_total", "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_count"):
        assert f"firstlight:{name}" in text


def test_completion_greedy_matches_reference(server, client, tiny) -> None:
    model, tok = tiny
    r = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
    ids = tok.encode("The quick brown fox")
    ref = full_forward_greedy(model, ids, 8)
    assert r.choices[0].text == tok.decode(ref, skip_special_tokens=True)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 8
    assert r.choices[0].finish_reason == "length"


def test_completion_stream_with_usage(server, client) -> None:
    full = client.completions.create(model="tiny", prompt="To be, or", max_tokens=10, temperature=0,
                                     extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(model="tiny", prompt="To be, or", max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == 10 and not chunks[-1].choices
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_stream_and_logprobs(server, client) -> None:
    msgs = [{"role": "user", "content": "Hello there"}]
    full = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0,
                                          logprobs=True, top_logprobs=2)
    lp = full.choices[0].logprobs.content
    assert len(lp) == full.usage.completion_tokens and len(lp[0].top_logprobs) == 2
    stream = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_multiple_prompts_and_seed(server, client) -> None:
    r = client.completions.create(model="tiny", prompt=["a b", "c d"], max_tokens=5, temperature=0.8, seed=7)
    assert [c.index for c in r.choices] == [0, 1]
    r2 = client.completions.create(model="tiny", prompt=["a b", "c d"], max_tokens=5, temperature=0.8, seed=7)
    assert [c.text for c in r.choices] == [c.text for c in r2.choices]


@pytest.mark.parametrize(
    "body",
    [
        {"model": "tiny", "prompt": "hi", "max_tokens": 1000},  # over the context length
        {"model": "tiny", "prompt": "hi", "max_tokens": -1},
        {"model": "tiny", "prompt": "hi", "temperature": -0.5},
        {"model": "tiny", "prompt": "hi", "top_p": 1.5},
        {"model": "tiny", "prompt": "hi", "n": 2},
        {"model": "tiny", "prompt": "hi", "logprobs": 50},
        {"model": "other", "prompt": "hi"},
        {"model": "tiny", "prompt": ""},
        {"model": "tiny", "prompt": [[]]},
        {"model": "tiny", "prompt": [999999]},
        {"model": "tiny"},
        {"model": "tiny", "prompt": "hi", "bogus_field": 1},
        {"model": "tiny", "prompt": "hi", "stream_options": {"include_usage": "yes please"}},
    ],
)
def test_malformed_completion_400(server, body) -> None:
    url, _ = server
    r = httpx.post(url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]


def test_malformed_json_and_chat_400(server) -> None:
    url, _ = server
    r = httpx.post(url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    for body in ({"model": "tiny", "messages": []}, {"model": "tiny", "messages": [{"role": "robot", "content": "x"}]},
                 {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}):
        assert httpx.post(url + "/v1/chat/completions", json=body).status_code == 400


def test_openai_client_raises_bad_request(client) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    assert "not served" in str(e.value)


def test_stream_disconnect_aborts_and_frees_blocks(server) -> None:
    url, engine = server
    body = {"model": "tiny", "prompt": "The quick", "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        got = 0
        for line in lines:
            if line.startswith("data: {"):
                got += 1
            if got >= 3:
                break
        assert engine.kv.num_used_blocks > 0
    assert wait_idle(engine), "blocks not freed after the client disconnected"
    assert engine.metrics.num_requests_finished["abort"] >= 1


def test_nonstream_disconnect_aborts(server) -> None:
    url, engine = server
    before = engine.metrics.num_requests_finished["abort"]
    body = json.dumps({"model": "tiny", "prompt": "Shall I", "max_tokens": 240, "ignore_eos": True}).encode()
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
    )
    deadline = time.monotonic() + 10
    while not engine.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert engine.has_unfinished(), "request never started"
    sock.close()  # the client goes away before the 240 tokens are done
    assert wait_idle(engine)
    assert engine.metrics.num_requests_finished["abort"] == before + 1


def test_reset_prefix_cache(server, client) -> None:
    url, engine = server
    client.completions.create(model="tiny", prompt="The capital of France is Paris. " * 3, max_tokens=2)
    assert engine.kv.cached
    assert httpx.post(url + "/reset_prefix_cache").status_code == 415  # no JSON body: refused
    assert engine.kv.cached
    r = httpx.post(url + "/reset_prefix_cache", json={})
    assert r.status_code == 200 and r.json()["num_dropped_blocks"] > 0
    assert not engine.kv.cached


def test_openapi_schema_served(server) -> None:
    url, _ = server
    schema = httpx.get(url + "/openapi.json").json()
    assert "/v1/completions" in schema["paths"] and "/v1/chat/completions" in schema["paths"]
    json.dumps(schema)
    time.sleep(0)


def test_cli_serve_with_trace(tiny_ckpt, tmp_path) -> None:
    import subprocess
    import sys

    from firstlight.core.trace import Trace

    from .server_helpers import free_port

    port = free_port()
    trace = tmp_path / "steps.jsonl"
    cmd = [sys.executable, "-m", "firstlight.cli", "serve", "--model", str(tiny_ckpt), "--port", str(port),
           "--trace", str(trace), "--served-model-name", "t", "--threads", "1", "--block-size", "4",
           "--no-native-decode"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read().decode()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                       json={"model": "t", "prompt": "The quick", "max_tokens": 5, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    steps = Trace.load(trace).steps
    assert len(steps) == 5  # one prefill step (also samples the first token) + 4 decode steps
    assert steps[0].batch.num_prefill_tokens > 0 and steps[-1].batch.num_decode_tokens == 1


def test_serve_loads_and_steps_on_one_thread(tiny, monkeypatch) -> None:
    """The model loads and the engine builds on the stepper thread, the one every step runs on: one thread ever
    runs torch's parallel regions, so libgomp keeps one worker pool (see `serve`)."""
    import threading

    import uvicorn

    from firstlight.engine import llm, server

    seen: dict[str, object] = {}

    def fake_load(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        seen["load"] = threading.current_thread()
        return tiny

    def fake_create_app(async_llm, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        seen["step"] = async_llm._stepper.submit(threading.current_thread).result()
        return object()

    monkeypatch.setattr(llm, "load", fake_load)
    monkeypatch.setattr(server, "create_app", fake_create_app)
    monkeypatch.setattr(server, "uvicorn_config", lambda *a, **k: None)
    monkeypatch.setattr(uvicorn.Server, "__init__", lambda self, config: None)
    monkeypatch.setattr(uvicorn.Server, "run", lambda self: None)
    server.serve("tiny")
    assert seen["load"] is seen["step"] and seen["load"] is not threading.main_thread()


def test_cli_serve_bad_model_is_one_line_error(tmp_path) -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "firstlight.cli", "serve", "--model", str(tmp_path / "nope")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "Traceback" not in out.stderr and "error" in out.stderr
