"""Run the HTTP server in a background thread on a free 127.0.0.1 port."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import uvicorn

from firstlight.engine.async_engine import AsyncLLM
from firstlight.engine.engine import EngineConfig, LLMEngine
from firstlight.engine.server import create_app, uvicorn_config
from firstlight.engine.server_guard import ServerLimits


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(model: Any, tokenizer: Any, name: str = "tiny", limits: ServerLimits | None = None,
                   **cfg: Any) -> Iterator[tuple[str, LLMEngine]]:
    """The server as `firstlight serve` runs it (same guard, same uvicorn protocol), in a thread."""
    engine = LLMEngine(model, tokenizer, EngineConfig(**cfg))
    limits = limits or ServerLimits()
    app = create_app(AsyncLLM(engine), name, limits)
    port = free_port()
    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, limits, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1, headers={"host": "localhost"}).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.05)
    else:
        raise RuntimeError("server did not start")
    try:
        yield url, engine
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        engine.close()


def wait_idle(engine: LLMEngine, timeout_s: float = 20) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not engine.has_unfinished() and engine.kv.num_used_blocks == 0:
            return True
        time.sleep(0.05)
    return False
