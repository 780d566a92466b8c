"""AsyncLLM's engine thread: steps run back to back while nothing waits between steps, outputs stream in
order, and a new request, an abort or stop() ends a run of steps after the current one."""

from __future__ import annotations

import asyncio

from firstlight.engine.async_engine import AsyncLLM
from firstlight.engine.engine import EngineConfig, LLMEngine
from firstlight.engine.request import SamplingParams


def _llm(tiny) -> tuple[AsyncLLM, LLMEngine, dict[str, int]]:
    model, tok = tiny
    engine = LLMEngine(model, tok, EngineConfig(block_size=4, num_blocks=512, max_model_len=256))
    llm = AsyncLLM(engine)
    counts = {"steps": 0, "runs": 0}
    step, steps = engine.step, llm._steps

    def counted_step():  # noqa: ANN202
        counts["steps"] += 1
        return step()

    def counted_steps(loop):  # noqa: ANN001, ANN202
        counts["runs"] += 1
        return steps(loop)

    engine.step = counted_step  # type: ignore[method-assign]
    llm._steps = counted_steps  # type: ignore[method-assign]
    return llm, engine, counts


def _params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_steps_back_to_back_stream_every_token_in_order(tiny) -> None:
    llm, engine, counts = _llm(tiny)
    model, tok = tiny
    reference = LLMEngine(model, tok, EngineConfig(block_size=4, num_blocks=512, max_model_len=256))
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    for i, p in enumerate(prompts):
        reference.add_request(p, _params(24), request_id=f"r{i}")
    done: dict[str, list[int]] = {}
    while reference.has_unfinished():
        done.update({o.request_id: o.output_token_ids for o in reference.step() if o.finished})
    want = [done["r0"], done["r1"]]

    async def run() -> list[list[int]]:
        async def one(p: list[int]) -> list[int]:
            ids: list[int] = []
            async for out in llm.generate(p, _params(24)):
                ids.extend(out.new_token_ids)
            return ids

        try:
            return list(await asyncio.gather(*(one(p) for p in prompts)))
        finally:
            await llm.stop()

    assert asyncio.run(run()) == want
    assert not engine.has_unfinished()
    # ~25 steps for 24 tokens each, in a handful of runs (one per new request, then to the end): not one each
    assert counts["steps"] >= 24 and counts["runs"] <= counts["steps"] // 4


def test_abort_mid_run_ends_only_that_request(tiny) -> None:
    llm, engine, _ = _llm(tiny)

    async def run() -> tuple[int, list[int]]:
        async def partial() -> int:
            seen = 0
            async for _ in llm.generate([5, 6, 7], _params(200)):
                seen += 1
                if seen == 3:
                    break  # the stream's consumer stops: AsyncLLM aborts the request
            return seen

        async def full() -> list[int]:
            ids: list[int] = []
            async for out in llm.generate([8, 9], _params(40)):
                ids.extend(out.new_token_ids)
            return ids

        try:
            seen, ids = await asyncio.gather(partial(), full())
            while engine.has_unfinished():  # the abort is applied between steps
                await asyncio.sleep(0.01)
            return seen, ids
        finally:
            await llm.stop()

    seen, ids = asyncio.run(run())
    assert seen == 3 and len(ids) == 40
    assert not engine.has_unfinished()


def test_stop_ends_a_run_of_steps(tiny) -> None:
    llm, engine, counts = _llm(tiny)

    async def run() -> int:
        seen = 0
        async for _ in llm.generate([5, 6, 7], _params(240)):
            seen += 1
            if seen == 3:
                await llm.stop()  # the engine thread stops after its current step, the request unfinished
                return seen
        return seen

    assert asyncio.run(run()) == 3
    assert engine.has_unfinished() and counts["steps"] < 240
