"""A reference OpenAI-compatible server that streams with known, exact delays.

The bench client is calibrated against it: since the server knows when it meant to send every
chunk (and stamps when it did), any difference the client measures is the client's own bias.

Timing model (per streamed request, t = 0 when the last bytes of the request reached this host: the
kernel's receive stamp, see firstlight/bench/stamped.py):
  chunk 0 carries 1 token and is written at t = first_token_ms;
  chunk k >= 1 carries up to tokens_per_chunk tokens and is written at
  t = first_token_ms + (tokens sent so far after chunk 0 + tokens in chunk k) * per_token_ms,
so TTFT = first_token_ms, ITL per token = per_token_ms, ITL per chunk = tokens_per_chunk *
per_token_ms and TPOT = per_token_ms exactly (speculative decoding sends multi-token chunks the
same way: one token from prefill, then k per step).

Written on raw sockets driven by the asyncio selector (no framework) so that one process sustains thousands of streamed
requests per second and the client under test, not this server, is the bottleneck. asyncio's
epoll selector rounds timer waits up to whole milliseconds; `PreciseSelector` wakes up to 1 ms
early and polls for the rest, so chunks leave within tens of microseconds of their schedule.

Run standalone: `python -m firstlight.bench.reference --port 8001 --first-token-ms 20`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import selectors
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields

from firstlight.bench.stamped import StampedTransport, serve_stamped
from firstlight.errors import FirstlightError

_WORDS = [" alpha", " beta", " gamma", " delta", " omega", " sigma", " kappa", " theta"]
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 429: "Too Many Requests", 500: "Internal Server Error",
            503: "Service Unavailable"}


@dataclass
class ReferenceConfig:
    """What the reference server injects. Times in milliseconds."""

    first_token_ms: float = 10.0
    per_token_ms: float = 2.0
    tokens_per_chunk: int = 1
    default_max_tokens: int = 16
    model: str = "firstlight-reference"
    error_rate: float = 0.0  # fraction of generation requests answered with `error_status`
    error_status: int = 500
    early_close_rate: float = 0.0  # fraction of streams closed after half their chunks
    seed: int = 0
    # interop quirks of other servers (0/1): end streams without `data: [DONE]`, send no usage at all,
    # answer 422 to a body with `ignore_eos` (a strict server without vLLM's extensions)
    send_done: int = 1
    send_usage: int = 1
    reject_ignore_eos: int = 0

    def __post_init__(self) -> None:
        if self.tokens_per_chunk < 1:
            raise FirstlightError(f"tokens_per_chunk={self.tokens_per_chunk}: expected >= 1.")
        if min(self.first_token_ms, self.per_token_ms) < 0:
            raise FirstlightError("reference server delays must be >= 0 ms.")


def _frame(data: bytes) -> bytes:
    """One HTTP/1.1 chunk."""
    return b"%x\r\n%s\r\n" % (len(data), data)


_DONE = _frame(b"data: [DONE]\n\n")


def chunk_schedule(num_tokens: int, cfg: ReferenceConfig) -> list[tuple[float, int]]:
    """(send offset in seconds after the request, tokens in the chunk) for every content chunk."""
    if num_tokens <= 0:
        return []
    out = [(cfg.first_token_ms / 1e3, 1)]
    sent = 0
    while sent < num_tokens - 1:
        n = min(cfg.tokens_per_chunk, num_tokens - 1 - sent)
        sent += n
        out.append(((cfg.first_token_ms + sent * cfg.per_token_ms) / 1e3, n))
    return out


class PreciseSelector(selectors.EpollSelector if hasattr(selectors, "EpollSelector") else selectors.DefaultSelector):  # type: ignore[misc]
    """A selector whose timeouts are not rounded up to whole milliseconds (see module doc)."""

    def select(self, timeout: float | None = None):  # type: ignore[override]
        if timeout is None or timeout <= 0:
            return super().select(timeout)
        deadline = time.monotonic() + timeout
        coarse = math.floor(timeout * 1e3) / 1e3
        if coarse > 0:
            ready = super().select(coarse)
            if ready:
                return ready
        # Spin on zero-timeout polls for the last sub-millisecond: sleeping instead would leave
        # arriving requests unread (and their receive time late) until the sleep ends.
        while True:
            ready = super().select(0)
            if ready or time.monotonic() >= deadline:
                return ready


def new_precise_loop() -> asyncio.AbstractEventLoop:
    return asyncio.SelectorEventLoop(PreciseSelector())


class _Counters:
    def __init__(self) -> None:
        self.requests = 0
        self.errors = 0
        self.early_closes = 0
        self.prefix_cache_resets = 0
        self.completed = 0


class _Conn:
    """One connection, driven by a `StampedTransport` (firstlight/bench/stamped.py)."""

    def __init__(self, server: ReferenceServer) -> None:
        self.srv = server
        self.buf = b""
        self.transport: StampedTransport | None = None
        self.busy = False  # a response is streaming; further pipelined requests wait
        self.handles: list[asyncio.TimerHandle] = []

    def connection_made(self, transport: StampedTransport) -> None:
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        for h in self.handles:
            h.cancel()
        self.transport = None

    def feed(self, data: bytes, t_now: float) -> None:
        """Bytes that arrived (kernel receive stamp where the OS gives one) at `t_now`."""
        self.buf += data
        if not self.busy:
            self._next_request(t_now)

    def _next_request(self, t_now: float) -> None:
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        head = self.buf[:end].decode("latin-1").split("\r\n")
        try:
            method, path, _ = head[0].split(" ", 2)
        except ValueError:
            self._reply(400, {"error": {"message": "bad request line"}}, close=True)
            return
        length = 0
        keep_alive = True
        for line in head[1:]:
            k, _, v = line.partition(":")
            k = k.strip().lower()
            if k == "content-length":
                length = int(v.strip())
            elif k == "connection" and v.strip().lower() == "close":
                keep_alive = False
        if len(self.buf) < end + 4 + length:
            return
        body = self.buf[end + 4 : end + 4 + length]
        self.buf = self.buf[end + 4 + length :]
        self.srv.route(self, method, path.split("?", 1)[0], body, t_now, keep_alive)

    # -- responses ------------------------------------------------------------------------------
    def _reply(self, status: int, obj: object, close: bool = False, content_type: str = "application/json") -> None:
        payload = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
        head = (
            f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}\r\nServer: firstlight-reference\r\n"
            f"Content-Type: {content_type}\r\nContent-Length: {len(payload)}\r\n"
            + ("Connection: close\r\n" if close else "")
            + "\r\n"
        )
        if self.transport is None:
            return
        self.transport.write(head.encode() + payload)
        if close:
            self.transport.close()
        elif self.buf:
            self._next_request(time.perf_counter())

    def write_chunk(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(_frame(data))

    def finish_stream(self, keep_alive: bool, tail: bytes = b"") -> None:
        """Write `tail` and the last-chunk marker in one send (fewer syscalls per request)."""
        self.handles.clear()
        self.busy = False
        if self.transport is None:
            return
        self.transport.write(tail + b"0\r\n\r\n")
        if not keep_alive:
            self.transport.close()
        elif self.buf:
            self._next_request(time.perf_counter())


def _prompt_tokens(req: dict, chat: bool) -> int:
    """Whitespace-separated words: the reference server's stand-in for a tokenizer."""
    if chat:
        total = 0
        for m in req.get("messages") or []:
            c = m.get("content", "")
            if isinstance(c, list):
                c = " ".join(p.get("text", "") for p in c if isinstance(p, dict))
            total += len(str(c).split())
        return total
    p = req.get("prompt", "")
    if isinstance(p, list):
        return len(p) if p and isinstance(p[0], int) else sum(len(str(x).split()) for x in p)
    return len(str(p).split())


class ReferenceServer:
    """The server object; `serve()` runs it on the current (preferably precise) event loop."""

    def __init__(self, cfg: ReferenceConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.counters = _Counters()
        self.next_id = 0

    def route(self, conn: _Conn, method: str, path: str, body: bytes, t0: float, keep_alive: bool) -> None:
        if method == "GET" and path == "/health":
            conn._reply(200, b"", close=not keep_alive, content_type="text/plain")
        elif method == "GET" and path == "/v1/models":
            data = [{"id": self.cfg.model, "object": "model", "created": 0, "owned_by": "firstlight-reference"}]
            conn._reply(200, {"object": "list", "data": data}, close=not keep_alive)
        elif method == "GET" and path == "/version":
            from firstlight import __version__ as v  # noqa: PLC0415

            conn._reply(200, {"version": f"firstlight-reference {v}"}, close=not keep_alive)
        elif method == "GET" and path == "/metrics":
            c = self.counters
            text = "".join(f"reference_{k}_total {getattr(c, k)}\n" for k in vars(c))
            conn._reply(200, text.encode(), close=not keep_alive, content_type="text/plain")
        elif method == "POST" and path == "/reset_prefix_cache":
            self.counters.prefix_cache_resets += 1
            conn._reply(200, b"", close=not keep_alive, content_type="text/plain")
        elif method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
            try:
                req = json.loads(body or b"{}")
            except json.JSONDecodeError:
                conn._reply(400, {"error": {"message": "body is not JSON", "type": "invalid_request_error"}},
                            close=not keep_alive)
                return
            self.generate(conn, req, path.endswith("chat/completions"), t0, keep_alive)
        else:
            conn._reply(404, {"error": {"message": f"no route {method} {path}"}}, close=not keep_alive)

    def generate(self, conn: _Conn, req: dict, chat: bool, t0: float, keep_alive: bool) -> None:
        cfg = self.cfg
        self.counters.requests += 1
        self.next_id += 1
        rid = f"ref-{self.next_id}"
        if cfg.error_rate > 0 and self.rng.random() < cfg.error_rate:
            self.counters.errors += 1
            conn._reply(cfg.error_status, {"error": {"message": "injected error", "type": "server_error"}},
                        close=not keep_alive)
            return
        if cfg.reject_ignore_eos and "ignore_eos" in req:
            self.counters.errors += 1
            conn._reply(422, {"detail": [{"type": "extra_forbidden", "loc": ["body", "ignore_eos"],
                                          "msg": "Extra inputs are not permitted"}]}, close=not keep_alive)
            return
        early_close = cfg.early_close_rate > 0 and self.rng.random() < cfg.early_close_rate
        n_out = int(req.get("max_completion_tokens") or req.get("max_tokens") or cfg.default_max_tokens)
        n_in = _prompt_tokens(req, chat)
        schedule = chunk_schedule(n_out, cfg)
        model = req.get("model") or cfg.model
        created = int(time.time())
        usage = {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}
        if not req.get("stream"):
            text = "".join(_WORDS[i % len(_WORDS)] for i in range(n_out))
            if chat:
                choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                obj = {"id": rid, "object": "chat.completion", "created": created, "model": model,
                       "choices": [choice], "usage": usage}
            else:
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
                obj = {"id": rid, "object": "text_completion", "created": created, "model": model,
                       "choices": [choice], "usage": usage}
            delay = schedule[-1][0] if schedule else 0.0
            h = asyncio.get_running_loop().call_at(
                _loop_time(t0 + delay), lambda: (self._count_done(), conn._reply(200, obj, close=not keep_alive)))
            conn.handles.append(h)
            conn.busy = True
            return
        opts = req.get("stream_options") or {}
        include_usage = bool(opts.get("include_usage")) and bool(cfg.send_usage)
        continuous = bool(opts.get("continuous_usage_stats")) and bool(cfg.send_usage)
        done = _DONE if cfg.send_done else b""
        conn.busy = True
        if conn.transport is None:
            return
        head = (b"HTTP/1.1 200 OK\r\nServer: firstlight-reference\r\nContent-Type: text/event-stream\r\n"
                b"Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n")
        kind = "chat.completion.chunk" if chat else "text_completion"
        prefix = f'{{"id":"{rid}","object":"{kind}","created":{created},"model":{json.dumps(model)},'
        if chat:  # OpenAI sends the role first with empty content; TTFT must not count it
            head += _frame(f'data: {prefix}"choices":[{{"index":0,"delta":{{"role":"assistant","content":""}},'
                           f'"finish_reason":null}}],"ref_t0":{t0!r}}}\n\n'.encode())
        conn.transport.write(head)
        loop = asyncio.get_running_loop()
        cut = len(schedule) // 2 if early_close else -1
        state = {"tok": 0}

        def send(k: int) -> None:
            if conn.transport is None:
                return
            if k == cut:
                self.counters.early_closes += 1
                conn.busy = False
                conn.transport.close()
                return
            _, n = schedule[k]
            text = "".join(_WORDS[(state["tok"] + i) % len(_WORDS)] for i in range(n))
            state["tok"] += n
            last = k == len(schedule) - 1
            fin = '"length"' if last else "null"
            if chat:
                choice = f'{{"index":0,"delta":{{"content":{json.dumps(text)}}},"finish_reason":{fin}}}'
            else:
                choice = f'{{"index":0,"text":{json.dumps(text)},"logprobs":null,"finish_reason":{fin}}}'
            extra = ""
            if continuous:
                c = state["tok"]
                extra = f',"usage":{{"prompt_tokens":{n_in},"completion_tokens":{c},"total_tokens":{n_in + c}}}'
            if k == 0:
                extra += f',"ref_t0":{t0!r}'
            data = _frame(f'data: {prefix}"choices":[{choice}]{extra},"ref_t":{time.perf_counter()!r}}}\n\n'.encode())
            if not last:
                conn.transport.write(data)
                conn.handles.append(loop.call_at(_loop_time(t0 + schedule[k + 1][0]), send, k + 1))
                return
            if include_usage:
                data += _frame(f'data: {prefix}"choices":[],"usage":{json.dumps(usage)}}}\n\n'.encode())
            self._count_done()
            conn.finish_stream(keep_alive, data + done)

        if not schedule:
            conn.finish_stream(keep_alive, done)
            return
        conn.handles.append(loop.call_at(_loop_time(t0 + schedule[0][0]), send, 0))

    def _count_done(self) -> None:
        self.counters.completed += 1


# perf_counter and the loop's monotonic clock are both CLOCK_MONOTONIC on Linux; keep the offset
# general anyway, measured once.
_OFFSET = time.monotonic() - time.perf_counter()


def _loop_time(t_perf: float) -> float:
    return t_perf + _OFFSET


async def serve(cfg: ReferenceConfig, host: str = "127.0.0.1", port: int = 0,
                ready: asyncio.Future | None = None) -> None:
    """Serve until cancelled. `ready` (if given) gets the bound port."""
    srv = ReferenceServer(cfg)
    loop = asyncio.get_running_loop()
    # Requests are read with the kernel's receive stamps too: a request's delays count from when
    # it reached this host, not from when this process got around to reading it.
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(4096)
        stop = serve_stamped(loop, sock, lambda: _Conn(srv))
        if ready is not None:
            ready.set_result(sock.getsockname()[1])
        else:
            print(f"READY {sock.getsockname()[1]}", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            stop()


@contextmanager
def reference_server(cfg: ReferenceConfig | None = None, *, timeout_s: float = 20.0) -> Iterator[str]:
    """Start the reference server in a child process (its own core and GIL); yield its base URL."""
    cfg = cfg or ReferenceConfig()
    args = [sys.executable, "-m", "firstlight.bench.reference", "--port", "0"]
    for f in fields(cfg):
        args += [f"--{f.name.replace('_', '-')}", str(getattr(cfg, f.name))]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    try:
        line = _read_ready(proc, timeout_s)
        yield f"http://127.0.0.1:{int(line.split()[1])}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _read_ready(proc: subprocess.Popen, timeout_s: float) -> str:
    import selectors as sel

    s = sel.DefaultSelector()
    assert proc.stdout is not None
    s.register(proc.stdout, sel.EVENT_READ)
    if not s.select(timeout_s):
        raise FirstlightError(f"reference server did not start within {timeout_s} s.")
    line = proc.stdout.readline()
    if not line.startswith("READY"):
        raise FirstlightError(f"reference server failed to start (exit {proc.poll()}); see its stderr above.")
    return line


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="firstlight reference server (exact injected delays)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    for f in fields(ReferenceConfig):
        typ = {"int": int, "float": float, "str": str}[f.type if isinstance(f.type, str) else f.type.__name__]
        p.add_argument(f"--{f.name.replace('_', '-')}", type=typ, default=f.default)
    a = p.parse_args(argv)
    cfg = ReferenceConfig(**{f.name: getattr(a, f.name) for f in fields(ReferenceConfig)})
    loop = new_precise_loop()
    try:
        loop.run_until_complete(serve(cfg, a.host, a.port))
    except KeyboardInterrupt:
        pass
    finally:
        loop.close()


def config_dict(cfg: ReferenceConfig) -> dict:
    return asdict(cfg)


if __name__ == "__main__":
    main()
