"""Where a single-stream decode step's wall time goes outside the kernels: the engine's phases and the ops
they call, each timed by a wrapper (perf_counter around the call; no profiler, whose per-op cost would
swamp the ~1 ms of Python being measured), summed over steady decode steps and divided by the steps.

    PYTHONPATH=. .venv/bin/python benchmarks/decode_overhead.py --model smollm2-135m --threads 2 --quantization int4

One engine with the native decode step (EngineConfig(native_decode=True)), --requests requests one after
another, each a prompt of --prompt-len random ids and --max-tokens greedy tokens (EOS ignored); the prefill
steps are left out. Nested rows include their children (NativeDecode.__call__ includes dense_decode, embed and
rope); "kernels" = firstlight's ops (dense_decode, the head's matmul, argmax), "overhead" = step wall - kernels. Rounds repeat
the whole measurement (this machine's speed drifts minute to minute: compare rows within a round).
"""

from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict
from collections.abc import Callable

import torch

OPS = ("dense_decode", "int8_mm", "int4_mm", "int4_mm_a8", "f32_mm", "f32_mm_packed", "argmax_rows")  # firstlight::


def wrap(owner: object, name: str, key: str, acc: dict[str, float]) -> None:
    fn: Callable = getattr(owner, name)

    def timed(*a, **k):  # noqa: ANN002, ANN003, ANN202
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[key] += time.perf_counter() - t

    setattr(owner, name, timed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quantization", default="int4")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from firstlight.engine import engine as engine_mod
    from firstlight.engine import native_decode, runner, sampler, scheduler
    from firstlight.engine.engine import EngineConfig, LLMEngine
    from firstlight.engine.request import SamplingParams
    from firstlight.models import hub
    from firstlight.models.loader import load_model
    from firstlight.quant import apply_quantization
    from firstlight.quant.f32 import use_f32_kernel

    model, tok = load_model(hub.resolve(args.model))
    apply_quantization(model, args.quantization)
    use_f32_kernel(model)  # as the server loads it
    engine = LLMEngine(model, tok, EngineConfig(
        block_size=16, num_blocks=(args.prompt_len + args.max_tokens) // 16 + 8, max_num_seqs=1, native_decode=True,
        kv_cache_dtype=args.kv_cache_dtype))
    if engine.runner.native_decode is None:
        raise SystemExit(f"the engine declined the native step: {engine.runner.native_decode_declined}")
    acc: dict[str, float] = defaultdict(float)
    for op in OPS:  # resolved first, so that the namespace holds the attribute to wrap
        if hasattr(torch.ops.firstlight, op):
            wrap(torch.ops.firstlight, op, f"op {op}", acc)
    for owner, names in ((engine_mod.LLMEngine, ("step",)), (scheduler.Scheduler, ("schedule", "update")),
                         (runner.ModelRunner, ("execute", "_make_cache", "_group_view")),
                         (native_decode.NativeDecode, ("__call__",)),
                         (type(model), ("embed", "compute_logits")), (sampler.Sampler, ("sample",))):
        for name in names:
            wrap(owner, name, f"{owner.__name__}.{name}", acc)

    g = torch.Generator().manual_seed(0)
    load = os.getloadavg()
    print(f"{args.model} {args.quantization}, KV {args.kv_cache_dtype}, {args.threads} thread(s), prompt "
          f"{args.prompt_len} + {args.max_tokens} tokens, {args.requests} requests a round; load average "
          f"{load[0]:.1f} {load[1]:.1f} {load[2]:.1f} on {os.cpu_count()} CPUs")
    for rnd in range(args.rounds):
        total, steps = defaultdict(float), 0
        for _ in range(args.requests):
            prompt = torch.randint(10, model.config.vocab_size - 10, (args.prompt_len,), generator=g).tolist()
            engine.add_request(prompt, SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True))
            engine.step()  # the prefill: not counted
            acc.clear()
            while engine.has_unfinished():
                engine.step()
                steps += 1
            for k, v in acc.items():
                total[k] += v
        wall = total["LLMEngine.step"]
        kernels = sum(total[f"op {op}"] for op in OPS)
        print(f"round {rnd + 1}: {steps} decode steps, {1e3 * wall / steps:.3f} ms a step ({steps / wall:.1f} tok/s); "
              f"kernels {1e3 * kernels / steps:.3f} ms, overhead {1e3 * (wall - kernels) / steps:.3f} ms "
              f"({(wall - kernels) / wall:.1%})")
        for k, v in sorted(total.items(), key=lambda kv: -kv[1]):
            if v:
                print(f"  {k:<32} {1e3 * v / steps:8.3f} ms")


if __name__ == "__main__":
    main()
