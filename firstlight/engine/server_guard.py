"""What stands between the network and the OpenAI endpoints: limits, auth, Host check, slow clients.

`ServerLimits` holds every knob (`firstlight serve --help` lists them). Two pieces enforce them:

* `Guard`, a plain ASGI middleware in front of the app. In this order it checks the Host header
  against an allow-list (against DNS rebinding: a page on evil.example that resolves to 127.0.0.1
  still sends `Host: evil.example`), the bearer token on every `/v1/*` and admin route (as vLLM's
  `--api-key`; compared in constant time), and then reads the request body itself: a declared
  `Content-Length` over `max_body_bytes` is answered 413 before one body byte is read, a chunked
  body is counted as it arrives and cut at the limit, and a body that takes longer than
  `body_timeout_s` gets 408. Only then does the app see the body (replayed from the buffer), so
  nothing downstream ever parses more than `max_body_bytes`.
* `GuardedH11Protocol`, uvicorn's h11 protocol with a header deadline: a connection whose request
  headers are not complete `header_timeout_s` after it opened (or after its previous response) is
  closed. uvicorn's own keep-alive timer stops at the first byte, so without this a client that
  sends one header byte a minute holds a connection forever (slowloris).

Error bodies are the OpenAI error object, like every other error of the server.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from firstlight.errors import FirstlightError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

log = logging.getLogger("firstlight.server")

ADMIN_PATHS = ("/reset_prefix_cache",)  # besides /v1/*; /health and /metrics stay open (as in vLLM)


@dataclass(frozen=True)
class ServerLimits:
    """Per-server limits and access control; checked on construction."""

    max_body_bytes: int = 4 << 20  # request body, bytes (a 1 M-character prompt fits)
    max_tokens: int = 4096  # generated tokens per prompt; also what `max_tokens: null` means
    max_prompts_per_request: int = 64  # prompts in one /v1/completions request
    request_timeout_s: float = 600.0  # a request still running then ends (finish_reason "length")
    header_timeout_s: float = 10.0  # request line + headers must arrive within this
    body_timeout_s: float = 30.0  # the whole body must arrive within this after the headers
    api_key: str | None = None  # bearer token for /v1/* and admin routes
    allowed_hosts: tuple[str, ...] | None = None  # Host header values accepted (None: any)
    escape_special_tokens: bool = False  # chat: special-token text in messages is tokenized as text

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_tokens", "max_prompts_per_request"):
            if getattr(self, name) < 1:
                raise FirstlightError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("request_timeout_s", "header_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise FirstlightError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        if self.api_key is not None and not self.api_key:
            raise FirstlightError("--api-key is empty; give a non-empty key or leave it out")


def error_body(message: str, status: int, code: str | None = None) -> bytes:
    kind = "invalid_request_error" if status < 500 else "internal_server_error"
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()


async def send_error(send: Send, status: int, message: str, code: str | None = None,
                     headers: list[tuple[bytes, bytes]] | None = None, close: bool = False) -> None:
    body = error_body(message, status, code)
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:  # the body was not read: the connection cannot carry another request
        hdrs.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": hdrs + (headers or [])})
    await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, name: bytes) -> bytes | None:
    for k, v in scope.get("headers", ()):
        if k == name:
            return v
    return None


def _host_name(host: bytes) -> str:
    """`Host` header value without the port ([v6]:port and name:port)."""
    h = host.decode("latin-1").strip().lower()
    if h.startswith("["):
        return h[: h.find("]") + 1] if "]" in h else h
    return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


def needs_key(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/") or path in ADMIN_PATHS


class _BodyTooLarge(Exception):
    pass


class Guard:
    """ASGI middleware: Host allow-list, bearer auth, body size limit and body timeout."""

    def __init__(self, app: Callable[..., Awaitable[None]], limits: ServerLimits) -> None:
        self.app, self.limits = app, limits
        self._key = limits.api_key.encode() if limits.api_key else None
        self._hosts = {h.lower() for h in limits.allowed_hosts} if limits.allowed_hosts else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self._hosts is not None:
            host = _host_name(_header(scope, b"host") or b"")
            if host not in self._hosts and "*" not in self._hosts:
                await send_error(send, 400, f"Host header {host!r} is not allowed by this server (--allowed-hosts)",
                                 "host_not_allowed", close=True)
                return
        if self._key is not None and needs_key(scope["path"]):
            auth = _header(scope, b"authorization") or b""
            scheme, _, token = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self._key):
                await send_error(send, 401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                 "invalid_api_key", headers=[(b"www-authenticate", b"Bearer")], close=True)
                return
        if scope["method"] in ("GET", "HEAD", "OPTIONS", "DELETE") and _header(scope, b"content-length") is None \
                and _header(scope, b"transfer-encoding") is None:
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limits.max_body_bytes:
            await self._too_large(send, int(declared))
            return
        try:
            body = await asyncio.wait_for(self._read_body(receive), self.limits.body_timeout_s)
        except _BodyTooLarge:
            await self._too_large(send, None)
            return
        except TimeoutError:
            await send_error(send, 408, f"the request body did not arrive within {self.limits.body_timeout_s:g} s",
                             "body_timeout", close=True)
            return
        if body is None:  # the client went away mid-body
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read_body(self, receive: Receive) -> bytes | None:
        parts, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return None
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.limits.max_body_bytes:
                raise _BodyTooLarge
            parts.append(chunk)
            if not msg.get("more_body", False):
                return b"".join(parts)

    async def _too_large(self, send: Send, declared: int | None) -> None:
        got = f"{declared} bytes" if declared is not None else "more than that"
        await send_error(send, 413, f"request body too large: {got}; this server accepts at most "
                         f"{self.limits.max_body_bytes} bytes (--max-body-bytes)", "body_too_large", close=True)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive() that hands over the buffered body once, then waits on the real one (disconnects)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's headers (see the module docstring)."""

    header_timeout_s: float = 10.0  # set per server by `protocol_with_header_timeout`

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._num_requests = 0
        self._header_timer: asyncio.TimerHandle | None = None
        self._arm_header_timer()

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_deadline, self._num_requests)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_deadline(self, armed_at: int) -> None:
        # no request's headers completed since the timer was armed, and none is being served
        waiting = self.cycle is None or self.cycle.response_complete
        if self._num_requests == armed_at and waiting and not self.transport.is_closing():
            if self.conn.our_state is not h11.ERROR:
                with _suppress_h11():
                    self.conn.send(h11.ConnectionClosed())
            self.transport.close()

    def handle_events(self) -> None:
        before = self.cycle
        super().handle_events()
        if self.cycle is not before:  # a request's headers are complete: its deadline is met
            self._num_requests += 1
            self._cancel_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)


class _suppress_h11:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return exc[0] is not None and issubclass(exc[0], h11.LocalProtocolError)  # type: ignore[arg-type]


def protocol_with_header_timeout(header_timeout_s: float) -> type[GuardedH11Protocol]:
    """A protocol class for `uvicorn.Config(http=...)` with this header deadline."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"header_timeout_s": header_timeout_s})
