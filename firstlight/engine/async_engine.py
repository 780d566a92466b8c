"""AsyncLLM: the engine behind an asyncio API that streams, for the server.

The engine loop is one asyncio task that runs `LLMEngine.step()` in a worker thread (so the event
loop keeps serving HTTP while the model computes), back to back while nothing waits to be applied
between steps, and routes outputs to per-request queues as each step ends. Every
step runs on the same worker thread: torch's OpenMP pool belongs to the thread that enters a
parallel region, so steps spread over asyncio's default executor would start a pool per thread, and
the idle pools' spinning threads would take cores from the one computing (measured: docs/PERFORMANCE.md).
New requests and aborts are applied between steps, on the loop thread, so the engine is only
ever touched by one thread at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from firstlight.engine.engine import LLMEngine, RequestOutput
from firstlight.engine.request import Request, SamplingParams


class AsyncLLM:
    def __init__(self, engine: LLMEngine, stepper: ThreadPoolExecutor | None = None) -> None:
        """stepper: the one-thread executor every step runs on (default: made at start). `serve` passes the one
        that loaded the model and built the engine, so that a single thread ever runs torch's parallel regions
        (see `serve` in engine/server.py)."""
        self.engine = engine
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException | _Expired]] = {}
        self._prompt_ids: dict[str, list[int]] = {}
        self._pending_aborts: set[str] = set()
        self._pending_adds: list[Request] = []
        self._pending_calls: list[tuple[Callable[[], Any], asyncio.Future[Any]]] = []
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._stepper: ThreadPoolExecutor | None = stepper  # the one thread every step runs on
        self._next_id = 0
        self._halt = False  # set by stop(): no further steps
        self.errored: BaseException | None = None

    def start(self) -> None:
        """Start the engine loop on the running event loop (idempotent)."""
        if self._loop_task is None or self._loop_task.done():
            self._halt = False
            self._wakeup = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        self._halt = True  # the engine thread ends its run of steps after the current one
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._loop_task
            self._loop_task = None
        if self._stepper is not None:
            self._stepper.shutdown(wait=True)
            self._stepper = None

    async def _run(self) -> None:
        assert self._wakeup is not None
        if self._stepper is None:
            self._stepper = ThreadPoolExecutor(1, thread_name_prefix="firstlight-engine")
        loop = asyncio.get_running_loop()
        while True:
            self._apply_pending()
            if not self.engine.has_unfinished() and not self._pending_adds and not self._pending_calls:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            try:
                outputs = await loop.run_in_executor(self._stepper, self._steps, loop)
            except Exception as e:  # a model failure ends every request with the error
                self.errored = e
                for q in self._queues.values():
                    q.put_nowait(e)
                self._queues.clear()
                raise
            self._deliver(outputs)
            # No yield here: the handlers that stream these outputs run while the next step computes (at
            # c = 32 they took ~4 ms a step between steps: 0.12 -> 0.07 s of gaps a run, docs/PERFORMANCE.md).

    def _steps(self, loop: asyncio.AbstractEventLoop) -> list[RequestOutput]:
        """On the engine thread: steps back to back while nothing waits to be applied between steps (a new
        request, an abort, a call) and work remains; each step's outputs but the last go to the loop as they
        come, the last with the returned future (call_soon_threadsafe keeps them in order). One executor round
        trip a step put two thread wake-ups on the critical path between every two steps (served, a single
        stream's tokens came 7.0 ms apart against 6.4 ms a step in process, same minutes); now the loop thread
        only delivers (docs/PERFORMANCE.md: 4-7% shorter median gaps, inside this machine's noise)."""
        while True:
            outputs = self.engine.step()
            if (self._halt or self._pending_adds or self._pending_aborts or self._pending_calls
                    or not self.engine.has_unfinished()):
                return outputs
            loop.call_soon_threadsafe(self._deliver, outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            q = self._queues.get(out.request_id)
            if q is not None:
                q.put_nowait(out)
                if out.finished:
                    del self._queues[out.request_id]

    def _apply_pending(self) -> None:
        calls, self._pending_calls = self._pending_calls, []
        for fn, fut in calls:
            try:
                fut.set_result(fn())
            except Exception as e:
                fut.set_exception(e)
        adds, self._pending_adds = self._pending_adds, []
        for req in adds:
            if req.request_id in self._pending_aborts:
                self._pending_aborts.discard(req.request_id)
                continue
            try:
                self.engine.add_request(req)
            except Exception as e:  # e.g. a duplicate id: fail that request only
                q = self._queues.pop(req.request_id, None)
                if q is not None:
                    q.put_nowait(e)
        if self._pending_aborts:
            ids = list(self._pending_aborts)
            self._pending_aborts.clear()
            self.engine.abort_request(ids)
            for rid in ids:
                self._queues.pop(rid, None)

    def add_request(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> str:
        """Queue a request (raises FirstlightError for a bad one); returns its id.

        Called on the loop thread while a step may be running in the worker: the request is
        validated now and handed to the scheduler between steps (see `_run`).
        """
        if self.errored is not None:
            raise RuntimeError(f"engine failed earlier: {self.errored}")
        if request_id is None:
            request_id = f"req-{self._next_id}"
            self._next_id += 1
        req = self.engine.make_request(prompt, params, request_id)
        self._queues[request_id] = asyncio.Queue()
        self._prompt_ids[request_id] = req.prompt_token_ids
        self._pending_adds.append(req)
        self.start()
        assert self._wakeup is not None
        self._wakeup.set()
        return request_id

    async def call_between_steps(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the engine when no step is in flight (e.g. resetting the prefix cache)."""
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending_calls.append((fn, fut))
        self.start()
        assert self._wakeup is not None
        self._wakeup.set()
        return await fut

    def expire(self, request_id: str) -> None:
        """End a request that ran out of time: aborted in the engine, and its stream ends with a final
        output (finish_reason "length", stop_reason "time_limit") holding what it had produced."""
        q = self._queues.get(request_id)
        prompt_ids = self._prompt_ids.get(request_id, [])
        self.abort(request_id)
        if q is not None:
            q.put_nowait(_Expired(prompt_ids))

    def abort(self, request_id: str) -> None:
        """Abort a request; applied before the next step. Its blocks are freed then."""
        self._queues.pop(request_id, None)
        self._prompt_ids.pop(request_id, None)
        self._pending_aborts.add(request_id)
        if self._wakeup is not None:
            self._wakeup.set()

    async def stream(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """Outputs of a request as they come; aborts it if the consumer stops early."""
        q = self._queues.get(request_id)
        if q is None:
            return
        finished = False
        last: RequestOutput | None = None
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise RuntimeError(f"engine error: {item}") from item
                if isinstance(item, _Expired):
                    finished = True
                    yield _expired_output(request_id, last, item.prompt_ids)
                    return
                last = item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._prompt_ids.pop(request_id, None)
            if not finished:
                self.abort(request_id)



    async def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        rid = self.add_request(prompt, params, request_id)
        async for out in self.stream(rid):
            yield out


@dataclasses.dataclass
class _Expired:
    """Queue marker: the request's time limit passed (see `AsyncLLM.expire`)."""

    prompt_ids: list[int]


def _expired_output(request_id: str, last: RequestOutput | None, prompt_ids: list[int]) -> RequestOutput:
    if last is None:
        last = RequestOutput(request_id, prompt_ids, [], [], "", "", False)
    return dataclasses.replace(last, new_token_ids=[], delta_text="", finished=True, finish_reason="length",
                               stop_reason="time_limit", new_logprobs=[])
