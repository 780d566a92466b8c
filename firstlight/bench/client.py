"""Async streaming client for OpenAI-compatible servers, and the per-request record it fills.

Two backends record the same `RequestRecord`:

* `raw` (default): HTTP/1.1 over keep-alive sockets driven by the asyncio selector, a chunk costs
  one callback, not a task wake-up. The arrival time of a chunk is the **kernel's receive
  timestamp** of the data (Linux `SO_TIMESTAMPING`, software RX stamps, read with `recvmsg`), so
  neither the client's own queue of ready sockets nor the scheduler's delay in waking the client
  process lands in the measurement. Where the kernel gives no stamp (another OS, TLS) the time is
  read in the read callback before any parsing. This is what keeps the measurement bias under
  0.5 ms and the client above 1,000 streamed requests/s on two cores (docs/BENCH.md,
  benchmarks/bench_client.py).
* `httpx`: the library client, for servers behind TLS proxies or anything the raw client does
  not speak. Timestamps are taken when `aiter_lines` yields, after httpx's own buffering.

Control-plane calls (/v1/models, /health, /reset_prefix_cache) use httpx: they are not timed.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit

from firstlight.bench.stamped import open_stamped
from firstlight.errors import FirstlightError


@dataclass
class RequestRecord:
    """Everything measured for one request. Times are `time.perf_counter()` seconds."""

    index: int
    session: int = 0
    turn: int = 0
    warmup: bool = False
    t_scheduled: float = 0.0  # when the load pattern wanted it sent
    t_send: float = 0.0  # just before the request bytes were written
    t_end: float = 0.0  # stream finished, failed or was cut
    status: int = 0  # HTTP status; 0 when no response came
    error: str | None = None  # kind: connect, http_<code>, early_close, timeout, bad_response, no_content
    error_detail: str = ""
    chunk_times: list[float] = field(default_factory=list)  # arrival of every non-empty content chunk
    chunk_chars: list[int] = field(default_factory=list)
    chunk_usage: list[int] = field(default_factory=list)  # cumulative completion_tokens when streamed
    chunk_tokens: list[int] = field(default_factory=list)  # tokens per content chunk (filled in post)
    server_times: list[float] = field(default_factory=list)  # reference server's send stamps, if any
    server_t0: float | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    usage_prompt_tokens: int | None = None
    usage_completion_tokens: int | None = None
    finish_reason: str | None = None  # of the (first) choice, once a chunk carried one
    text: str = ""
    _parts: list[str] = field(default_factory=list, repr=False)

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("_parts", None)
        return d


def build_body(endpoint: str, model: str, prompt: Any, max_tokens: int, *, ignore_eos: bool = True,
               continuous_usage: bool = True, extra: dict | None = None) -> dict:
    """The JSON body of a streamed request; `prompt` is a string (completions) or messages (chat)."""
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "stream": True,
                            "stream_options": {"include_usage": True}}
    if continuous_usage:
        body["stream_options"]["continuous_usage_stats"] = True
    if endpoint == "chat":
        body["messages"] = prompt
    else:
        body["prompt"] = prompt
    if ignore_eos:
        body["ignore_eos"] = True
    if extra:
        body.update(extra)
    return body


def _handle_event(rec: RequestRecord, payload: bytes, t: float) -> bool:
    """Apply one SSE `data:` payload; True when the stream says it is done."""
    if payload == b"[DONE]":
        return True
    try:
        obj = json.loads(payload.decode())  # str: skips json's encoding detection
    except ValueError:
        rec.error, rec.error_detail = "bad_response", payload[:200].decode("utf-8", "replace")
        return True
    if "error" in obj and not obj.get("choices"):
        rec.error, rec.error_detail = "stream_error", str(obj["error"])[:200]
        return True
    usage = obj.get("usage")
    choices = obj.get("choices")
    if choices:
        c = choices[0]
        if c.get("finish_reason"):
            rec.finish_reason = c["finish_reason"]
        delta = c.get("delta")
        text = delta.get("content") if delta is not None else c.get("text")
        if text:
            rec.chunk_times.append(t)
            rec.chunk_chars.append(len(text))
            rec._parts.append(text)
            if usage:
                rec.chunk_usage.append(usage.get("completion_tokens") or 0)
            if "ref_t" in obj:
                rec.server_times.append(obj["ref_t"])
        if "ref_t0" in obj:
            rec.server_t0 = obj["ref_t0"]
    if usage:
        rec.usage_prompt_tokens = usage.get("prompt_tokens")
        rec.usage_completion_tokens = usage.get("completion_tokens")
    return False


class _StreamProtocol(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; parses a chunked (or sized) SSE response as it arrives."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.rec: RequestRecord | None = None
        self.done: asyncio.Future | None = None

    def start(self, rec: RequestRecord, data: bytes, done: asyncio.Future) -> None:
        self.rec, self.done = rec, done
        self.buf = b""
        self.sse = b""
        self.head = True
        self.mode = "close"
        self.remaining = 0
        self.keep_alive = True
        self.stream_done = False
        rec.t_send = time.perf_counter()
        assert self.transport is not None
        self.transport.write(data)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.feed(data, time.perf_counter())

    def feed(self, data: bytes, t: float) -> None:
        """Bytes that arrived at perf_counter time `t`."""
        rec = self.rec
        if rec is None or self.done is None or self.done.done():
            return
        self.buf += data
        if self.head:
            i = self.buf.find(b"\r\n\r\n")
            if i < 0:
                return
            lines = self.buf[:i].decode("latin-1").split("\r\n")
            self.buf = self.buf[i + 4 :]
            self.head = False
            try:
                rec.status = int(lines[0].split(" ", 2)[1])
            except (IndexError, ValueError):
                self._finish("bad_response", lines[0][:200])
                return
            for line in lines[1:]:
                k, _, v = line.partition(":")
                k, v = k.strip().lower(), v.strip().lower()
                if k == "transfer-encoding" and "chunked" in v:
                    self.mode = "chunked"
                elif k == "content-length" and self.mode != "chunked":
                    self.mode, self.remaining = "length", int(v)
                elif k == "connection" and v == "close":
                    self.keep_alive = False
        self._body(t)

    def _body(self, t: float) -> None:
        if self.mode == "chunked":
            # Walk the buffer with an index and hand all complete chunk payloads over at once:
            # slicing the buffer per chunk made this quadratic when many chunks arrive together.
            buf, pos, parts, end = self.buf, 0, [], False
            while True:
                if self.remaining == 0:
                    j = buf.find(b"\r\n", pos)
                    if j < 0:
                        break
                    size = int(buf[pos:j].split(b";", 1)[0], 16)
                    pos = j + 2
                    if size == 0:
                        end = True
                        break
                    self.remaining = size
                if len(buf) - pos < self.remaining + 2:
                    break
                parts.append(buf[pos : pos + self.remaining])
                pos += self.remaining + 2
                self.remaining = 0
            self.buf = buf[pos:]
            if parts:
                self._payload(parts[0] if len(parts) == 1 else b"".join(parts), t)
            if end and self.done is not None and not self.done.done():
                self._end_of_body(t)
        elif self.mode == "length":
            take = self.buf[: self.remaining]
            self.buf = self.buf[len(take) :]
            self.remaining -= len(take)
            self._payload(take, t)
            if self.remaining <= 0:
                self._end_of_body(t)
        else:
            self._payload(self.buf, t)
            self.buf = b""

    def _payload(self, data: bytes, t: float) -> None:
        rec = self.rec
        assert rec is not None
        sse = self.sse + data if self.sse else data
        if rec.status != 200:
            self.sse = sse
            return
        if b"\r" in sse:
            sse = sse.replace(b"\r\n", b"\n")
        events = sse.split(b"\n\n")
        self.sse = events.pop()
        for event in events:
            for line in event.split(b"\n"):
                if line.startswith(b"data:") and _handle_event(rec, line[5:].strip(), t):
                    self.stream_done = True
                    if rec.error:
                        self._finish(rec.error, rec.error_detail)
                        return

    def _end_of_body(self, t: float) -> None:
        rec = self.rec
        assert rec is not None
        if rec.status != 200:
            self._finish(f"http_{rec.status}", self.sse[:300].decode("utf-8", "replace"))
        elif not self.stream_done and self.sse.strip():  # non-streamed JSON answer
            self._finish("bad_response", "expected an SSE stream, got: " + self.sse[:200].decode("utf-8", "replace"))
        else:
            # a stream that ends cleanly after a finish_reason chunk is complete without `data: [DONE]`
            # (servers that omit it exist; the OpenAI spec sends it, but the answer is whole either way)
            done = self.stream_done or rec.finish_reason is not None
            self._finish(None if done else "early_close", "")

    def _finish(self, error: str | None, detail: str) -> None:
        rec = self.rec
        assert rec is not None and self.done is not None
        rec.t_end = time.perf_counter()
        if error is None and not rec.chunk_times:
            error, detail = "no_content", "the stream carried no non-empty content chunk"
        rec.error, rec.error_detail = error, detail
        if error is not None and self.transport is not None:
            self.keep_alive = False
        if not self.done.done():
            self.done.set_result(self.keep_alive)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.rec is not None and self.done is not None and not self.done.done():
            if self.mode == "close" and not self.head and self.rec.status == 200:
                self._end_of_body(time.perf_counter())
            else:
                self._finish("early_close", str(exc or "server closed the connection mid-response"))


def _expire(done: asyncio.Future) -> None:
    if not done.done():
        done.set_exception(TimeoutError())


class RawClient:
    """Streams requests over a pool of keep-alive connections to one base URL."""

    def __init__(self, base_url: str, *, timeout_s: float = 600.0, api_key: str | None = None) -> None:
        u = urlsplit(base_url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise FirstlightError(f"server URL {base_url!r}: expected http(s)://host[:port]; fix --url.")
        self.host = u.hostname
        self.port = u.port or (443 if u.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if u.scheme == "https" else None
        self.path_prefix = u.path.rstrip("/")
        if self.path_prefix.endswith("/v1"):
            self.path_prefix = self.path_prefix[:-3]
        self.hostport = f"{self.host}:{self.port}"
        self.timeout_s = timeout_s
        self.auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
        self.idle: list[_StreamProtocol] = []
        self.kernel_stamps = 0  # connections whose reads carry the kernel's receive timestamps
        self.connections = 0

    @property
    def arrival_clock(self) -> str:
        if self.connections and self.kernel_stamps == self.connections:
            return "kernel receive timestamp (SO_TIMESTAMPING)"
        if self.kernel_stamps:
            return f"kernel receive timestamp on {self.kernel_stamps} of {self.connections} connections, else read callback"
        return "read callback (time.perf_counter before parsing)"

    def encode(self, path: str, body: dict) -> bytes:
        payload = json.dumps(body).encode()
        head = (f"POST {self.path_prefix}{path} HTTP/1.1\r\nHost: {self.hostport}\r\n"
                f"Content-Type: application/json\r\nAccept: text/event-stream\r\n{self.auth}"
                f"Content-Length: {len(payload)}\r\n\r\n")
        return head.encode() + payload

    async def stream(self, rec: RequestRecord, path: str, body: dict) -> RequestRecord:
        data = self.encode(path, body)
        loop = asyncio.get_running_loop()
        proto = None
        while self.idle:
            p = self.idle.pop()
            if not p.closed:
                proto = p
                break
        if proto is None:
            try:
                if self.ssl is None:
                    proto = _StreamProtocol()
                    await open_stamped(loop, self.host, self.port, proto)
                else:
                    _, proto = await loop.create_connection(_StreamProtocol, self.host, self.port, ssl=self.ssl)
                self.connections += 1
                self.kernel_stamps += bool(getattr(proto.transport, "stamped", False))
            except OSError as e:
                rec.t_send = rec.t_end = time.perf_counter()
                rec.error, rec.error_detail = "connect", str(e)
                return rec
        done = loop.create_future()
        proto.start(rec, data, done)
        # a plain timer, not asyncio.wait_for: no extra task per request
        timer = loop.call_later(self.timeout_s, _expire, done)
        try:
            keep = await done
        except TimeoutError:
            rec.t_end = time.perf_counter()
            rec.error, rec.error_detail = "timeout", f"no end of stream within {self.timeout_s} s"
            keep = False
        except asyncio.CancelledError:
            if proto.transport is not None:
                proto.transport.abort()
            raise
        finally:
            timer.cancel()
        rec.text = "".join(rec._parts)
        proto.rec = None
        if keep and not proto.closed:
            self.idle.append(proto)
        elif proto.transport is not None:
            proto.transport.close()
        return rec

    async def aclose(self) -> None:
        for p in self.idle:
            if p.transport is not None:
                p.transport.close()
        self.idle.clear()


class HttpxClient:
    """The same contract on httpx (slower; timestamps after httpx's line buffering)."""

    arrival_clock = "httpx aiter_lines (after httpx's buffering)"

    def __init__(self, base_url: str, *, timeout_s: float = 600.0, api_key: str | None = None) -> None:
        import httpx

        base = base_url.rstrip("/")
        self.base = base[:-3] if base.endswith("/v1") else base
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.AsyncClient(timeout=timeout_s, headers=headers,
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))

    async def stream(self, rec: RequestRecord, path: str, body: dict) -> RequestRecord:
        import httpx

        rec.t_send = time.perf_counter()
        try:
            async with self.client.stream("POST", self.base + path, json=body) as r:
                rec.status = r.status_code
                if r.status_code != 200:
                    detail = (await r.aread())[:300].decode("utf-8", "replace")
                    rec.error, rec.error_detail = f"http_{r.status_code}", detail
                else:
                    finished = False
                    async for line in r.aiter_lines():
                        t = time.perf_counter()
                        if line.startswith("data:") and _handle_event(rec, line[5:].strip().encode(), t):
                            finished = True
                            break
                    if not finished and rec.error is None and rec.finish_reason is None:
                        rec.error = "early_close"  # neither [DONE] nor a finish_reason: cut short
        except httpx.TimeoutException as e:
            rec.error, rec.error_detail = "timeout", str(e)
        except httpx.ConnectError as e:
            rec.error, rec.error_detail = "connect", str(e)
        except (httpx.RemoteProtocolError, httpx.ReadError) as e:
            rec.error, rec.error_detail = "early_close", str(e)
        rec.t_end = time.perf_counter()
        if rec.error is None and not rec.chunk_times:
            rec.error = "no_content"
        rec.text = "".join(rec._parts)
        return rec

    async def aclose(self) -> None:
        await self.client.aclose()


BACKENDS = {"raw": RawClient, "httpx": HttpxClient}


def make_client(backend: str, base_url: str, **kw: Any) -> RawClient | HttpxClient:
    if backend not in BACKENDS:
        raise FirstlightError(f"client backend {backend!r}: expected one of {sorted(BACKENDS)}.")
    return BACKENDS[backend](base_url, **kw)


def endpoint_path(endpoint: str) -> str:
    if endpoint not in ("completions", "chat"):
        raise FirstlightError(f"endpoint {endpoint!r}: expected 'completions' or 'chat'.")
    return "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"


# -- control plane (not timed) ---------------------------------------------------------------------
def _base(url: str) -> str:
    b = url.rstrip("/")
    return b[:-3] if b.endswith("/v1") else b


def preflight(url: str, *, timeout_s: float = 10.0, api_key: str | None = None) -> dict[str, Any]:
    """Check the server answers before any load starts; return its models and version info.

    Raises FirstlightError naming the URL when it cannot be reached or is not OpenAI-compatible.
    """
    import httpx

    base = _base(url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(base + "/v1/models", timeout=timeout_s, headers=headers)
    except httpx.HTTPError as e:
        raise FirstlightError(
            f"server {url!r} is unreachable ({type(e).__name__}: {e}); start the server or fix --url. "
            "No requests were sent."
        ) from None
    if r.status_code != 200:
        raise FirstlightError(f"server {url!r}: GET /v1/models returned HTTP {r.status_code}; "
                              "expected an OpenAI-compatible server.")
    try:
        models = [m["id"] for m in r.json().get("data", [])]
    except (ValueError, KeyError, TypeError, AttributeError):
        raise FirstlightError(f"server {url!r}: /v1/models did not return an OpenAI model list.") from None
    info: dict[str, Any] = {"url": url, "models": models, "server_header": r.headers.get("server")}
    try:
        v = httpx.get(base + "/version", timeout=timeout_s, headers=headers)
        if v.status_code == 200:
            info["version"] = v.json().get("version")
    except (httpx.HTTPError, ValueError, AttributeError):
        pass
    return info


def reset_prefix_cache(url: str, *, timeout_s: float = 30.0, api_key: str | None = None) -> bool:
    """POST /reset_prefix_cache (a JSON body, as firstlight's and vLLM's servers take); False when the
    server has no such endpoint."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.post(_base(url) + "/reset_prefix_cache", json={}, headers=headers, timeout=timeout_s)
    except httpx.HTTPError:
        return False
    return r.status_code < 300
