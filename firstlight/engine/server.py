"""OpenAI-compatible HTTP server (FastAPI): completions, chat completions, models, health, metrics.

Every bad request gets a 400 with the OpenAI error object
`{"error": {"message", "type": "invalid_request_error", "param", "code"}}`. A client that
disconnects has its request aborted (its KV blocks are freed before the next step): streaming
responses notice through cancellation of the SSE generator, non-streaming ones through a task
that listens for `http.disconnect` (the pattern vLLM uses).

Safe to expose (docs/SERVING.md, "Exposing the server"): the limits, the API key, the Host
allow-list and the slow-client timeouts live in `server_guard.py`; prompts are tokenized and chat
templates applied by `prompts.py`, in a worker thread (a 1 MB prompt does not stall other streams or /health), text the
tokenizer rejects is a 400, every request has a time limit, and a 500 never carries internal
exception text (it is logged, with its traceback, under an id the client gets).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from firstlight.engine.async_engine import AsyncLLM
from firstlight.engine.engine import RequestOutput
from firstlight.engine.prompts import BadRequest, PromptTokenizer
from firstlight.engine.protocol import ChatCompletionRequest, CompletionRequest, ResetPrefixCacheRequest
from firstlight.engine.request import SamplingParams
from firstlight.engine.sampler import TokenLogprobs
from firstlight.engine.server_guard import Guard, ServerLimits, protocol_with_header_timeout
from firstlight.engine.server_schema import install_openapi
from firstlight.errors import FirstlightError

log = logging.getLogger("firstlight.server")


def error_response(message: str, status: int = 400, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "internal_server_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def internal_error(exc: BaseException | None = None) -> JSONResponse:
    """A 500 that tells the client an id to quote, and keeps the exception text in the server log."""
    eid = uuid.uuid4().hex[:12]
    log.error("internal error %s", eid, exc_info=exc)
    return error_response(f"internal server error (id {eid}; the server log has the details)", 500)


async def with_disconnect(request: Request, coro: Awaitable[Response]) -> Response | None:
    """Run the handler, cancelling it if the client goes away first."""

    async def wait_disconnect() -> None:
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                return

    handler = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(wait_disconnect())
    done, _ = await asyncio.wait({handler, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if handler in done:
        watcher.cancel()
        return handler.result()
    handler.cancel()
    return None


class OpenAIServing:
    """The endpoints' logic, separate from the FastAPI wiring."""

    def __init__(self, llm: AsyncLLM, model_name: str, limits: ServerLimits | None = None) -> None:
        self.llm = llm
        self.model_name = model_name
        self.limits = limits or ServerLimits()
        self.engine = llm.engine
        self.tokenizer = llm.engine.tokenizer
        self.prompts = PromptTokenizer(self.tokenizer, escape_special_tokens=self.limits.escape_special_tokens)
        self.created = int(time.time())

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise BadRequest(
                f"model '{name}' is not served here; this server serves '{self.model_name}' (see /v1/models)",
                param="model",
                code="model_not_found",
            )

    def check_speculation(self, requested: int | None) -> None:
        """`num_speculative_tokens` must lie in [0, the server's k]; asking a server that does not
        speculate for k > 0 is a 400 (not silently 0), so a client never believes it got speculation
        it did not. 0 is always accepted (it means off)."""
        if not requested:
            return
        spec = self.engine.config.speculative
        if spec is None:
            raise BadRequest(
                f"num_speculative_tokens={requested} but this server runs without speculative decoding; "
                "omit it (or pass 0), or start the server with --speculative ngram|draft|heads",
                param="num_speculative_tokens",
                code="speculation_not_enabled",
            )
        if requested > spec.num_spec_tokens:
            raise BadRequest(
                f"num_speculative_tokens={requested} exceeds this server's --num-spec-tokens "
                f"{spec.num_spec_tokens} ({spec.method}); pass a value in [0, {spec.num_spec_tokens}]",
                param="num_speculative_tokens",
            )

    def max_tokens(self, prompt_len: int, requested: int | None) -> int:
        limit = self.engine.max_model_len
        if prompt_len >= limit:
            raise BadRequest(
                f"the prompt has {prompt_len} tokens but the context length is {limit}; shorten it",
                param="prompt",
                code="context_length_exceeded",
            )
        if requested is None:
            return min(limit - prompt_len, self.limits.max_tokens)
        if requested > self.limits.max_tokens:
            raise BadRequest(
                f"max_tokens {requested} exceeds this server's limit of {self.limits.max_tokens} tokens per "
                "request (--max-tokens-limit); ask for fewer",
                param="max_tokens",
            )
        if prompt_len + requested > limit:
            raise BadRequest(
                f"prompt ({prompt_len} tokens) + max_tokens ({requested}) = {prompt_len + requested} exceeds the "
                f"context length {limit}; lower max_tokens or shorten the prompt",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return requested

    def check_num_prompts(self, num: int) -> None:
        if num > self.limits.max_prompts_per_request:
            raise BadRequest(
                f"{num} prompts in one request; this server takes at most {self.limits.max_prompts_per_request} "
                "(--max-prompts-per-request): split them over several requests",
                param="prompt",
            )

    def _deadline(self) -> float:
        return asyncio.get_running_loop().time() + self.limits.request_timeout_s

    def _expire_at(self, deadline: float, rids: list[str]) -> asyncio.TimerHandle:
        """End these requests at the deadline (finish_reason "length", stop_reason "time_limit")."""
        def expire() -> None:
            for rid in rids:
                self.llm.expire(rid)

        return asyncio.get_running_loop().call_at(deadline, expire)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)

    # ---- completions -----------------------------------------------------------------------
    async def completions(self, req: CompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        self.check_speculation(req.num_speculative_tokens)
        raw_prompts = req.prompts()
        self.check_num_prompts(len(raw_prompts))
        deadline = self._deadline()
        # off the event loop: a 1 MB prompt takes the tokenizer a while, and other streams keep going
        prompts = await asyncio.to_thread(self.prompts.tokenize_prompts, raw_prompts)
        self.prompts.check_stop(req.stop)
        params = [req.sampling_params(self.max_tokens(len(ids), req.max_tokens), req.logprobs) for ids in prompts]
        base_id = f"cmpl-{uuid.uuid4().hex}"
        rids = self._add_all(base_id, prompts, params)
        timer = self._expire_at(deadline, rids)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        if req.stream:
            return self._sse(self._completion_chunks(base_id, rids, include_usage), timer)
        try:
            resp = await with_disconnect(raw, self._completion_full(base_id, rids))
        finally:
            timer.cancel()
        return resp if resp is not None else Response(status_code=499)

    def _add_all(self, base_id: str, prompts: list[list[int]], params: list[SamplingParams]) -> list[str]:
        rids = []
        try:
            for i, (ids, sp) in enumerate(zip(prompts, params, strict=True)):
                rids.append(self.llm.add_request(ids, sp, f"{base_id}-{i}"))
        except BaseException:
            for rid in rids:
                self.llm.abort(rid)
            raise
        return rids

    async def _merged(self, rids: list[str]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of several requests as they arrive, tagged with the prompt index."""
        if len(rids) == 1:
            async for out in self.llm.stream(rids[0]):
                yield 0, out
            return
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

        async def pump(i: int, rid: str) -> None:
            try:
                async for out in self.llm.stream(rid):
                    queue.put_nowait((i, out))
                queue.put_nowait((i, None))
            except Exception as e:
                queue.put_nowait((i, e))

        tasks = [asyncio.ensure_future(pump(i, rid)) for i, rid in enumerate(rids)]
        try:
            remaining = len(rids)
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            for rid in rids:
                self.llm.abort(rid)  # no-op for finished ones

    def _completion_logprobs(self, lps: list[TokenLogprobs], offset: int) -> dict[str, Any]:
        tokens, token_lps, tops, offsets = [], [], [], []
        for lp in lps:
            text = self.token_text(lp.token_id)
            tokens.append(text)
            token_lps.append(lp.logprob)
            tops.append({self.token_text(t): v for t, v in lp.top})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    async def _completion_full(self, base_id: str, rids: list[str]) -> Response:
        finals: dict[int, RequestOutput] = {}
        async for i, out in self._merged(rids):
            if out.finished:
                finals[i] = out
        choices = []
        num_prompt = num_out = 0
        for i in range(len(rids)):
            out = finals[i]
            num_prompt += len(out.prompt_token_ids)
            num_out += len(out.output_token_ids)
            choice: dict[str, Any] = {
                "index": i,
                "text": out.text,
                "logprobs": self._completion_logprobs(out.logprobs, 0) if out.logprobs else None,
                "finish_reason": out.finish_reason,
                "stop_reason": out.stop_reason,
            }
            if out.prompt_logprobs is not None:
                choice["prompt_logprobs"] = [
                    None if lp is None else {str(t): v for t, v in [(lp.token_id, lp.logprob), *lp.top]}
                    for lp in out.prompt_logprobs
                ]
            choices.append(choice)
        return JSONResponse(
            {
                "id": base_id,
                "object": "text_completion",
                "created": int(time.time()),
                "model": self.model_name,
                "choices": choices,
                "usage": _usage(num_prompt, num_out),
            }
        )

    async def _completion_chunks(self, base_id: str, rids: list[str], include_usage: bool) -> AsyncIterator[str]:
        created = int(time.time())
        num_prompt: dict[int, int] = {}
        num_out: dict[int, int] = {}
        offsets: dict[int, int] = {}
        async for i, out in self._merged(rids):
            num_prompt[i] = len(out.prompt_token_ids)
            num_out[i] = len(out.output_token_ids)
            if not out.delta_text and not out.finished and not out.new_logprobs:
                continue
            lps = None
            if out.new_logprobs:
                lps = self._completion_logprobs(out.new_logprobs, offsets.get(i, 0))
            offsets[i] = offsets.get(i, 0) + len(out.delta_text)
            chunk = {
                "id": base_id,
                "object": "text_completion",
                "created": created,
                "model": self.model_name,
                "choices": [
                    {"index": i, "text": out.delta_text, "logprobs": lps, "finish_reason": out.finish_reason}
                ],
            }
            yield _sse(chunk)
        if include_usage:
            chunk = {
                "id": base_id,
                "object": "text_completion",
                "created": created,
                "model": self.model_name,
                "choices": [],
                "usage": _usage(sum(num_prompt.values()), sum(num_out.values())),
            }
            yield _sse(chunk)
        yield "data: [DONE]\n\n"

    # ---- chat ------------------------------------------------------------------------------
    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        self.check_speculation(req.num_speculative_tokens)
        deadline = self._deadline()
        ids = await asyncio.to_thread(self.prompts.chat_prompt, req.messages, req.add_generation_prompt)
        self.prompts.check_stop(req.stop)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        n_lp = (req.top_logprobs or 0) if req.logprobs else None
        if req.top_logprobs and not req.logprobs:
            raise BadRequest("top_logprobs needs logprobs=true", param="top_logprobs")
        params = req.sampling_params(self.max_tokens(len(ids), requested), n_lp)
        base_id = f"chatcmpl-{uuid.uuid4().hex}"
        rids = self._add_all(base_id, [ids], [params])
        timer = self._expire_at(deadline, rids)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        if req.stream:
            return self._sse(self._chat_chunks(base_id, rids[0], include_usage), timer)
        try:
            resp = await with_disconnect(raw, self._chat_full(base_id, rids[0]))
        finally:
            timer.cancel()
        return resp if resp is not None else Response(status_code=499)

    def _chat_logprobs(self, lps: list[TokenLogprobs]) -> dict[str, Any]:
        def entry(t: int, v: float) -> dict[str, Any]:
            text = self.token_text(t)
            return {"token": text, "logprob": v, "bytes": list(text.encode())}

        return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                            for lp in lps]}

    async def _chat_full(self, base_id: str, rid: str) -> Response:
        final = None
        async for out in self.llm.stream(rid):
            if out.finished:
                final = out
        assert final is not None
        return JSONResponse(
            {
                "id": base_id,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": self.model_name,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": final.text},
                        "logprobs": self._chat_logprobs(final.logprobs) if final.logprobs else None,
                        "finish_reason": final.finish_reason,
                        "stop_reason": final.stop_reason,
                    }
                ],
                "usage": _usage(len(final.prompt_token_ids), len(final.output_token_ids)),
            }
        )

    async def _chat_chunks(self, base_id: str, rid: str, include_usage: bool) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(delta: dict[str, Any], finish: str | None, lps: Any = None) -> str:
            return _sse(
                {
                    "id": base_id,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": self.model_name,
                    "choices": [{"index": 0, "delta": delta, "logprobs": lps, "finish_reason": finish}],
                }
            )

        yield chunk({"role": "assistant", "content": ""}, None)
        last = None
        async for out in self.llm.stream(rid):
            last = out
            if not out.delta_text and not out.finished and not out.new_logprobs:
                continue
            lps = self._chat_logprobs(out.new_logprobs) if out.new_logprobs else None
            yield chunk({"content": out.delta_text} if out.delta_text else {}, out.finish_reason, lps)
        if include_usage and last is not None:
            yield _sse(
                {
                    "id": base_id,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": self.model_name,
                    "choices": [],
                    "usage": _usage(len(last.prompt_token_ids), len(last.output_token_ids)),
                }
            )
        yield "data: [DONE]\n\n"

    @staticmethod
    def _sse(gen: AsyncIterator[str], timer: asyncio.TimerHandle | None = None) -> StreamingResponse:
        async def guarded() -> AsyncIterator[str]:
            # headers are sent by now: a failure mid-stream ends it with an error event, not a dropped socket
            try:
                async for item in gen:
                    yield item
            except Exception as e:
                eid = uuid.uuid4().hex[:12]
                log.error("internal error %s in a stream", eid, exc_info=e)
                yield _sse({"error": {"message": f"internal server error (id {eid}; the server log has the "
                                                 "details)", "type": "internal_server_error", "param": None,
                                      "code": None}})
                yield "data: [DONE]\n\n"
            finally:
                if timer is not None:
                    timer.cancel()

        return StreamingResponse(guarded(), media_type="text/event-stream")


def _usage(num_prompt: int, num_out: int) -> dict[str, int]:
    return {"prompt_tokens": num_prompt, "completion_tokens": num_out, "total_tokens": num_prompt + num_out}


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


_UNION_TAG = re.compile(r"^(str|int|float|bool|none|.*\[.*\])$")


def _validation_message(exc: RequestValidationError | ValidationError) -> tuple[str, str | None]:
    """One line naming the field. For a union (prompt: str | list[str] | ...) pydantic reports every
    member; the check that knew what was meant (a `value_error` from our validators) wins, and the
    members' tags (`function-after[...]`, `list[int]`) are dropped from the path."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    if any(e.get("type") == "json_invalid" for e in errors):
        return "the request body is not valid JSON; send a JSON object", None
    e = next((e for kind in ("value_error", "string_unicode") for e in errors if e.get("type") == kind), errors[0])
    loc = [str(x) for x in e.get("loc", ()) if x != "body" and not _UNION_TAG.match(str(x))]
    param = ".".join(loc) or None
    msg = str(e.get("msg", "invalid")).removeprefix("Value error, ")
    if e.get("type") == "string_unicode":
        msg = "not valid Unicode text (a lone surrogate such as \\ud800); send UTF-8 text"
    return f"{param or 'request'}: {msg}", param


def create_app(llm: AsyncLLM, model_name: str, limits: ServerLimits | None = None) -> FastAPI:
    limits = limits or ServerLimits()
    serving = OpenAIServing(llm, model_name, limits)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        llm.start()
        yield
        await llm.stop()

    app = FastAPI(title="firstlight", lifespan=lifespan)
    app.state.serving = serving
    app.state.limits = limits
    app.add_middleware(Guard, limits=limits)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(message, 400, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # keeps the exception's headers: `Allow` on a 405
        return error_response(str(exc.detail), exc.status_code, code=None, headers=exc.headers)

    @app.exception_handler(BadRequest)
    async def _bad(_: Request, exc: BadRequest) -> JSONResponse:
        return error_response(str(exc), 400, exc.param, exc.code)

    @app.exception_handler(FirstlightError)
    async def _fl(_: Request, exc: FirstlightError) -> JSONResponse:
        return error_response(str(exc), 400)

    @app.exception_handler(ValidationError)
    async def _pyd(_: Request, exc: ValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(message, 400, param)

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        return internal_error(exc)

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await serving.completions(body, raw)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(body: ChatCompletionRequest, raw: Request) -> Response:
        return await serving.chat(body, raw)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": serving.created,
                    "owned_by": "firstlight",
                    "max_model_len": llm.engine.max_model_len,
                }
            ],
        }

    @app.get("/health")
    async def health() -> Response:
        if llm.errored is not None:
            return error_response("the engine failed; the server log has the details", 500)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        eng = llm.engine
        text = eng.metrics.render(
            model_name, eng.kv.usage, eng.scheduler.num_running, eng.scheduler.num_waiting
        )
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(raw: Request) -> Response:
        # a JSON body (even `{}`) is required: a cross-site page cannot send one without a CORS
        # preflight, which this server never grants, so a browser cannot be used to reset the cache
        ctype = raw.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != "application/json":
            return error_response("POST a JSON object (e.g. {}) with Content-Type: application/json", 415,
                                  code="unsupported_media_type")
        try:
            ResetPrefixCacheRequest.model_validate_json(await raw.body())
        except ValidationError as e:
            message, param = _validation_message(e)
            return error_response(message, 400, param)
        n = await llm.call_between_steps(llm.engine.reset_prefix_cache)
        return JSONResponse({"num_dropped_blocks": n})

    install_openapi(app)
    return app


def uvicorn_config(app: FastAPI, host: str, port: int, limits: ServerLimits, **kw: Any) -> Any:
    """uvicorn settings that go with the limits: the header deadline, and idle keep-alive closes."""
    import uvicorn

    return uvicorn.Config(app, host=host, port=port, http=protocol_with_header_timeout(limits.header_timeout_s),
                          timeout_keep_alive=5, h11_max_incomplete_event_size=64 * 1024, **kw)


def serve(
    model: str, host: str = "127.0.0.1", port: int = 8000, trace: str | None = None,
    dtype: str = "float32", served_name: str | None = None, quantization: str | None = None,
    limits: ServerLimits | None = None, **engine_kwargs: Any,
) -> None:
    """Load the model and run the server until interrupted (blocking).

    The model loads and the engine builds on the thread that then runs every step. libgomp keeps a pool of
    worker threads per thread that ever ran a parallel region, and once its threads outnumber the cores its
    barriers spin ~100 times and then sleep in the kernel instead of spinning ~3 ms: a load on the main thread
    and steps on another gave a 2-thread server 3 threads on 2 cores, and a single-stream int4 decode step
    of 11 ms in process took 33 ms per token through the server (docs/PERFORMANCE.md)."""
    from concurrent.futures import ThreadPoolExecutor

    import uvicorn

    from firstlight.engine.engine import EngineConfig, LLMEngine
    from firstlight.engine.llm import load

    limits = limits or ServerLimits()

    def build() -> LLMEngine:
        m, tok = load(model, dtype, quantization)
        return LLMEngine(m, tok, EngineConfig(trace_path=trace, **engine_kwargs))

    stepper = ThreadPoolExecutor(1, thread_name_prefix="firstlight-engine")
    engine = stepper.submit(build).result()
    app = create_app(AsyncLLM(engine, stepper), served_name or model, limits)
    try:
        uvicorn.Server(uvicorn_config(app, host, port, limits, log_level="warning")).run()
    finally:
        engine.close()
