"""The raw client's HTTP/1.1 parsing: any split of the bytes gives the same record."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from firstlight.bench.client import RequestRecord, _StreamProtocol


class FakeTransport:
    def __init__(self):
        self.sent = b""
        self.closed = False

    def write(self, data):
        self.sent += data

    def close(self):
        self.closed = True

    def abort(self):
        self.closed = True


def _chunked(events: list[bytes]) -> bytes:
    body = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events)
    return b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n" + body + b"0\r\n\r\n"


def _events() -> list[bytes]:
    out = [b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n']
    for i, t in enumerate(["He", "llo", " world"]):
        out.append(b"data: " + json.dumps({"choices": [{"delta": {"content": t}}],
                                           "usage": {"completion_tokens": i + 1}}).encode() + b"\n\n")
    out.append(b'data: {"choices":[],"usage":{"prompt_tokens":4,"completion_tokens":3}}\r\n\r\n')
    out.append(b"data: [DONE]\n\n")
    return out


def _feed(pieces: list[bytes], close_after: bool = False) -> tuple[RequestRecord, bool]:
    loop = asyncio.new_event_loop()
    try:
        p = _StreamProtocol()
        p.connection_made(FakeTransport())
        done = loop.create_future()
        rec = RequestRecord(index=0)
        p.start(rec, b"req", done)
        for x in pieces:
            p.data_received(x)
        if close_after:
            p.connection_lost(None)
        assert done.done()
        rec.text = "".join(rec._parts)
        return rec, done.result()
    finally:
        loop.close()


@pytest.mark.parametrize("seed", range(8))
def test_any_split_parses_the_same(seed):
    data = _chunked(_events())
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(data)), 25))
    pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
    rec, keep_alive = _feed(pieces)
    assert rec.ok and keep_alive
    assert rec.text == "Hello world" and rec.chunk_chars == [2, 3, 6] and rec.chunk_usage == [1, 2, 3]
    assert rec.usage_prompt_tokens == 4 and rec.usage_completion_tokens == 3 and rec.status == 200


def test_error_status_and_early_close():
    body = b'{"error": "overloaded"}'
    rec, keep = _feed([b"HTTP/1.1 429 Too Many\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)])
    assert rec.error == "http_429" and "overloaded" in rec.error_detail and not keep
    data = _chunked(_events())
    rec, _ = _feed([data[: len(data) // 2]], close_after=True)
    assert rec.error == "early_close"


def test_non_streamed_answer_is_a_bad_response():
    body = b'{"choices": [{"text": "hi"}]}'
    rec, _ = _feed([b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)])
    assert rec.error == "bad_response"


def test_kernel_time_converts_the_realtime_stamp_to_perf_counter():
    import socket
    import struct
    import time

    from firstlight.bench.stamped import _SO_TIMESTAMPING, kernel_time

    now = time.perf_counter()
    real = time.time() - 0.010  # a segment stamped 10 ms ago
    raw = struct.pack("qq", int(real), int((real % 1) * 1e9)) + b"\0" * 32
    t = kernel_time([(socket.SOL_SOCKET, _SO_TIMESTAMPING, raw)], now)
    assert abs((now - t) - 0.010) < 0.002
    assert kernel_time([], now) == now  # no stamp: the callback's time
    future = time.time() + 5
    raw = struct.pack("qq", int(future), 0) + b"\0" * 32
    assert kernel_time([(socket.SOL_SOCKET, _SO_TIMESTAMPING, raw)], now) == now  # never after the read


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="SO_TIMESTAMPING is Linux's")
def test_chunks_are_stamped_by_the_kernel_after_the_server_sent_them(ref_url, cfg):
    from firstlight.bench.run import run_benchmark

    res = run_benchmark(cfg(ref_url, n=6, c=3))
    assert res.output.arrival_clock.startswith("kernel receive timestamp")
    recs = [r for r in res.output.records if r.ok]
    assert recs and all(len(r.server_times) == len(r.chunk_times) for r in recs)
    for r in recs:
        # causality on one clock: the server stamps a chunk before writing it, the kernel after
        assert all(c >= s - 2e-4 for c, s in zip(r.chunk_times, r.server_times, strict=True))
        assert r.server_t0 >= r.t_send - 2e-4
