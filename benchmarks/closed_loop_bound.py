"""The servers benchmark's closed-loop workload in process, each phase next to its roofline bound measured in
the same round: where an engine's c = 32 run loses to the bound, prefill or decode, without HTTP or a client.

    PYTHONPATH=. .venv/bin/python benchmarks/closed_loop_bound.py --threads 2 --rounds 4

The engine is built as `firstlight serve` builds it (engine/llm.py `load`, the default EngineConfig but
max_num_seqs = c); c requests of --prompt-len random token ids (the servers client's 128 plus its nonce: 142)
and --output-len tokens (EOS ignored, temperature 1.0 as the server's default) are added at once and stepped
to the end. Prefill = the steps until the last prompt token is computed (they carry the early requests'
first decode rows too, as a server's steps do), decode = the rest. The bound is benchmarks/servers.py's
(`bound_phases_s`: prompts at the better GEMM rate of M = 128 and M = c x 128 up to 2,048, each decode step
max(bytes / memory bandwidth, FLOPs / the M = c rate), attention's FLOPs and K/V bytes counted), its rates and
bandwidth measured in every round just before the run, so a slow phase of a shared machine moves both.
--chunks A,B: engines with those max_num_batched_tokens, alternating within each round; --kv-cache-dtypes
auto,fp16: engines with those K/V caches (each bound reads its K/V size), alternating the same way.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from _common import memory_bandwidth_gbs
from servers import bound_ms, bound_phases_s, kernel_rates, model_work, prompt_rate


def run_once(engine, c: int, prompt_len: int, output_len: int, vocab: int, seed: int) -> tuple[float, float, int]:
    """(prefill s, decode s, steps) of one closed-loop batch."""
    from firstlight.engine.request import SamplingParams

    rng = random.Random(seed)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=1.0)
    for i in range(c):
        engine.add_request([rng.randrange(vocab) for _ in range(prompt_len)], params, f"r{seed}-{i}")
    t0 = time.perf_counter()
    t_prefill, steps = None, 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if t_prefill is None and not engine.scheduler.waiting and all(
                r.num_computed_tokens >= r.num_prompt_tokens for r in engine.scheduler.running):
            t_prefill = time.perf_counter()
    t1 = time.perf_counter()
    return t_prefill - t0, t1 - t_prefill, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quantization", default="none", choices=["none", "int8", "int4", "w4a8", "w8a8"])
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=142)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--chunks", default="2048", help="max_num_batched_tokens of each engine, comma-separated")
    ap.add_argument("--kv-cache-dtypes", default="auto", help="K/V storage of each engine (auto, bf16, fp16)")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from firstlight.engine.engine import EngineConfig, LLMEngine
    from firstlight.engine.llm import load
    from firstlight.engine.runner import kv_pool_dtype
    from firstlight.models import hub
    from firstlight.quant import model_weight_bytes

    c, kernel = args.concurrency, "fp32" if args.quantization == "none" else args.quantization
    params, head_params, attn, shapes = model_work(hub.resolve(args.model))
    model, tok = load(args.model, "float32", None if args.quantization == "none" else args.quantization)
    wb = model_weight_bytes(model)
    chunks = [int(x) for x in args.chunks.split(",")]
    kvs = args.kv_cache_dtypes.split(",")
    engines = {(n, kv): LLMEngine(model, tok, EngineConfig(max_num_seqs=c, max_num_batched_tokens=n, kv_cache_dtype=kv))
               for n in chunks for kv in kvs}
    vocab = model.config.vocab_size
    for (n, _), e in engines.items():  # warm-up: kernels built, oneDNN weights reordered, pools touched
        run_once(e, c, args.prompt_len, 4, vocab, seed=10**9 + n)
    print(f"{args.model} {args.quantization} ({kernel} kernels), c = {c}, prompts {args.prompt_len}, "
          f"{args.output_len} output tokens, {args.threads} thread(s); weights {wb / 1e6:.0f} MB")
    print("\n| round | chunk | K/V | mem GB/s | GEMM prompts / M=c GFLOP/s | prefill s (bound) | decode s (bound) | "
          "wall s (bound) | bound / wall | steps |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    runs: dict[tuple[int, str], list[tuple[float, float, float, float]]] = {k: [] for k in engines}  # (prefill, decode, bounds)
    for r in range(args.rounds):
        for (n, kv), engine in engines.items():
            bw = memory_bandwidth_gbs()
            rate = kernel_rates(bound_ms(c), shapes, (kernel,))[kernel]
            bp, bd = bound_phases_s(wb, params, head_params, bw, rate, c, args.output_len, args.prompt_len, attn,
                                    kv_pool_dtype(kv, torch.float32).itemsize)
            p, d, steps = run_once(engine, c, args.prompt_len, args.output_len, vocab, seed=r * 1000 + n)
            runs[n, kv].append((p, d, bp, bd))
            print(f"| {r} | {n} | {kv} | {bw:.1f} | {prompt_rate(rate, c):.0f} / {rate[c]:.0f} | {p:.3f} ({bp:.3f}) | "
                  f"{d:.3f} ({bd:.3f}) | {p + d:.3f} ({bp + bd:.3f}) | {(bp + bd) / (p + d):.3f} | {steps} |", flush=True)
    print()
    for (n, kv), rs in runs.items():
        ratios = [(bp + bd) / (p + d) for p, d, bp, bd in rs]
        print(f"chunk {n}, K/V {kv}: bound / wall median {statistics.median(ratios):.3f} (rounds: "
              + ", ".join(f"{x:.3f}" for x in ratios) + f"); prefill {statistics.median(bp / p for p, _, bp, _ in rs):.3f}"
              f", decode {statistics.median(bd / d for _, d, _, bd in rs):.3f} of their bounds")


if __name__ == "__main__":
    main()
