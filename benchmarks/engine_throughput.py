"""Engine output tokens/s vs HF transformers `generate`, and per-step overhead vs execute time.

Workload (issue 4): N requests, prompt P random token ids, exactly O output tokens each (greedy,
EOS ignored). The engine keeps `c` requests in flight (closed loop: a new one starts when one
finishes); HF `generate` runs the same requests in batches of `c` (left-padded), which is the
best static batching can do. Same process, same weights, same thread count.

    .venv/bin/python benchmarks/engine_throughput.py --model smollm2-135m --threads 2

Prints, per concurrency: engine tok/s, HF tok/s, the ratio, and the engine's median per-step
schedule, execute and sample(+update+detokenize) times, next to a hardware bound on output tok/s
for the same workload (`workload_bound`): benchmarks/servers.py's bound for a closed loop of c requests
(prompts at the better GEMM rate of M = 128 and M = c x 128 up to 2,048; decode steps of batch c, each
max(weight + K/V bytes / memory bandwidth, matmul + attention FLOPs / the M = c rate)), once per wave of c
requests. The rates are those of the kernel the engine runs, measured here over the model's own linear shapes
(servers.kernel_rates "fp32": firstlight's fp32 linears, as `firstlight serve` and engine/llm.py `load` set up the
model: packed panels on AVX-512 builds, tiles and oneDNN elsewhere), not torch.mm's (MKL runs its AVX2 code on
AMD CPUs: a bound from its rate sat below what the engine does).
`--compile` adds, per concurrency, eager vs torch.compile'd shape-bucketed decode: alternating runs
(`--compile-repeats`), medians, graphs built in a warm-up run first so compile time is excluded:

    .venv/bin/python benchmarks/engine_throughput.py --model smollm2-135m --threads 1 --skip-hf \
        --compile --num-requests 8 --num-requests-c1 2 --output-len 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from _common import memory_bandwidth_gbs
from servers import bound_ms, bound_phases_s, isas, kernel_rates, model_work, prompt_rate


def make_prompts(num: int, prompt_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (num, prompt_len), generator=g).tolist()


def run_engine(model, tok, prompts, output_len, concurrency, compile_decode=False, kv_cache_dtype="auto") -> dict:
    from firstlight.core.trace import Trace
    from firstlight.engine.engine import EngineConfig, LLMEngine
    from firstlight.engine.request import SamplingParams

    sp = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    with tempfile.TemporaryDirectory() as d:
        trace_path = Path(d) / "trace.jsonl"
        cfg = EngineConfig(block_size=16, kv_cache_bytes=2 << 30, max_num_seqs=concurrency,
                           max_num_batched_tokens=2048, compile_decode=compile_decode, trace_path=trace_path,
                           kv_cache_dtype=kv_cache_dtype)
        engine = LLMEngine(model, tok, cfg)
        pending = list(prompts)
        num_out = 0
        t0 = time.perf_counter()
        while pending or engine.has_unfinished():
            while pending and engine.scheduler.num_running + engine.scheduler.num_waiting < concurrency:
                engine.add_request(pending.pop(0), sp)
            for out in engine.step():
                if out.finished:
                    num_out += len(out.output_token_ids)
        wall = time.perf_counter() - t0
        num_compiles = engine.runner.num_decode_compiles
        engine.close()
        steps = Trace.load(trace_path).steps
    decode_steps = [s for s in steps if s.batch.num_prefill_tokens == 0]
    return {
        "tok_s": num_out / wall,
        "wall_s": wall,
        "num_steps": len(steps),
        "median_schedule_ms": 1e3 * statistics.median(s.schedule_s for s in steps),
        "median_execute_ms": 1e3 * statistics.median(s.execute_s for s in steps),
        "median_sample_ms": 1e3 * statistics.median(s.sample_s for s in steps),
        "median_decode_execute_ms": 1e3 * statistics.median(s.execute_s for s in decode_steps) if decode_steps else 0,
        "median_decode_batch": statistics.median(s.batch.num_seqs for s in decode_steps) if decode_steps else 0,
        "num_decode_compiles": num_compiles,
    }


def compare_compiled(model, tok, prompts, output_len: int, concurrency: int, repeats: int) -> dict:
    """Eager vs compiled decode, alternating runs (so load drift on a shared machine hits both),
    after a warm-up that builds the compiled graphs (they persist per model): medians of tok/s and of
    each run's median decode-step execute time."""
    run_engine(model, tok, prompts[:concurrency], output_len, concurrency, compile_decode=True)
    runs: dict[str, list[dict]] = {"eager": [], "compiled": []}
    for _ in range(repeats):
        runs["eager"].append(run_engine(model, tok, prompts, output_len, concurrency))
        runs["compiled"].append(run_engine(model, tok, prompts, output_len, concurrency, compile_decode=True))
    med = {kind: {"tok_s": statistics.median(r["tok_s"] for r in rs),
                  "decode_execute_ms": statistics.median(r["median_decode_execute_ms"] for r in rs)}
           for kind, rs in runs.items()}
    graphs = runs["compiled"][-1]["num_decode_compiles"]
    e, k = med["eager"], med["compiled"]
    print(f"     compile (median of {repeats} alternating runs): {k['tok_s']:.1f} tok/s vs eager {e['tok_s']:.1f} "
          f"({k['tok_s'] / e['tok_s']:.2f}x); decode step execute {k['decode_execute_ms']:.2f} ms vs "
          f"{e['decode_execute_ms']:.2f} ms ({e['decode_execute_ms'] / k['decode_execute_ms']:.2f}x); "
          f"{graphs} graphs compiled so far", flush=True)
    return {"median": med, "runs": runs, "num_decode_compiles": graphs}


def workload_bound(work: tuple, num_requests: int, prompt_len: int, output_len: int, concurrency: int,
                   rates: dict[int, float], bandwidth_gbs: float, kv_bytes: int = 4) -> dict:
    """Output tok/s no implementation can beat here for the workload: num_requests / c waves of servers.py's
    closed-loop bound (c prompts, then output_len - 1 decode steps of batch c), fp32 weights, K/V of kv_bytes.
    work: servers.model_work's (matmul params, head params, attention shape, linear shapes)."""
    params, head_params, attn, _ = work
    waves = num_requests / concurrency
    prefill_s, decode_s = bound_phases_s(4 * params, params, head_params, bandwidth_gbs, rates, concurrency,
                                         output_len, prompt_len, attn, kv_bytes)
    return {"tok_s": num_requests * output_len / (waves * (prefill_s + decode_s)),
            "prefill_s": waves * prefill_s, "decode_s": waves * decode_s, "weight_bytes": 4 * params}


def run_hf(path: Path, prompts, output_len, batch_size, device: torch.device | str = "cpu",
           dtype: torch.dtype = torch.float32, warmup: bool = False) -> dict:
    """HF `generate` over the prompts in static batches (warmup: one batch first, untimed)."""
    from transformers import AutoModelForCausalLM

    device = torch.device(device)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()
    pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0

    def generate(batch: list[list[int]]) -> int:
        ids = torch.tensor(batch, device=device)  # equal lengths: no padding needed
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                          min_new_tokens=output_len, do_sample=False, pad_token_id=pad)
        return (out.shape[1] - ids.shape[1]) * out.shape[0]

    with torch.inference_mode():
        if warmup:
            generate(prompts[:batch_size])
        sync(device)
        t0 = time.perf_counter()
        num_out = sum(generate(prompts[i : i + batch_size]) for i in range(0, len(prompts), batch_size))
        sync(device)
    wall = time.perf_counter() - t0
    return {"tok_s": num_out / wall, "wall_s": wall, "num_out": num_out}


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA), so wall times cover it."""
    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="model name or checkpoint dir")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--num-requests-c1", type=int, default=None,
                    help="requests at concurrency 1 (default: --num-requests); fewer keeps the run short")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--compile", action="store_true", help="also compare eager vs torch.compile'd decode")
    ap.add_argument("--compile-repeats", type=int, default=3, help="alternating eager/compiled runs per concurrency")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bf16", "fp16"],
                    help="the engine's K/V storage (auto: fp32); the bound reads K/V of that size")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    from firstlight.engine.llm import load
    from firstlight.engine.runner import kv_pool_dtype
    from firstlight.models.hub import resolve

    path = resolve(args.model)
    model, tok = load(path)  # as `firstlight serve` runs it: fp32 linears on firstlight's tiles and oneDNN
    cfg = model.config
    num_params = sum(p.numel() for p in model.parameters())
    prompts_all = make_prompts(args.num_requests, args.prompt_len, cfg.vocab_size)
    run_engine(model, tok, prompts_all[:2], 4, 2)  # warm-up
    work = model_work(path)

    def measured(c: int) -> tuple[float, dict[int, float]]:  # mem GB/s, the engine's fp32 GFLOP/s for the prompts and at c
        return memory_bandwidth_gbs(), kernel_rates(bound_ms(c), work[3], ("fp32",))["fp32"]

    print(f"model {args.model}: {num_params / 1e6:.1f}M params fp32, threads={args.threads}, "
          f"prompt {args.prompt_len} / output {args.output_len}, K/V {args.kv_cache_dtype}; each bound from the memory bandwidth and the engine's "
          "fp32 GEMM rates over the model's linears, measured just before and just after its engine run (mean); "
          + ", ".join(f"{k}: {v}" for k, v in isas().items() if k != "llama.cpp"))
    print(f"{'conc':>4} {'reqs':>4} {'engine tok/s':>13} {'HF tok/s':>9} {'ratio':>6} {'bound tok/s':>11} "
          f"{'eng %':>6} {'HF %':>5} {'sched ms':>9} {'exec ms':>8} {'sample ms':>9} {'decode exec ms':>14} "
          f"{'GFLOP/s':>8}  mem GB/s, GFLOP/s of prompts / at M = c")
    results = []
    for c in args.concurrency:
        n = args.num_requests_c1 if (c == 1 and args.num_requests_c1) else args.num_requests
        prompts = prompts_all[:n]
        before = measured(c)
        eng = run_engine(model, tok, prompts, args.output_len, c, kv_cache_dtype=args.kv_cache_dtype)
        after = measured(c)
        bandwidth = (before[0] + after[0]) / 2
        rates = {m: (before[1][m] + after[1][m]) / 2 for m in before[1]}
        hf = None if args.skip_hf else run_hf(path, prompts, args.output_len, c)
        bound = workload_bound(work, n, args.prompt_len, args.output_len, c, rates, bandwidth,
                               kv_pool_dtype(args.kv_cache_dtype, torch.float32).itemsize)
        # 2 FLOPs per parameter per token (matmuls), prompt + output tokens, over the engine's wall time
        gflops = 2 * num_params * n * (args.prompt_len + args.output_len) / eng["wall_s"] / 1e9
        ratio = f"{eng['tok_s'] / hf['tok_s']:.2f}" if hf else "-"
        hf_s = f"{hf['tok_s']:.1f}" if hf else "-"
        hf_pct = f"{100 * hf['tok_s'] / bound['tok_s']:.0f}" if hf else "-"
        print(f"{c:>4} {n:>4} {eng['tok_s']:>13.1f} {hf_s:>9} {ratio:>6} {bound['tok_s']:>11.1f} "
              f"{100 * eng['tok_s'] / bound['tok_s']:>6.0f} {hf_pct:>5} {eng['median_schedule_ms']:>9.3f} "
              f"{eng['median_execute_ms']:>8.2f} {eng['median_sample_ms']:>9.3f} "
              f"{eng['median_decode_execute_ms']:>14.2f} {gflops:>8.1f}  {bandwidth:.1f}, {prompt_rate(rates, c):.0f} / {rates[c]:.0f}",
              flush=True)
        row = {"concurrency": c, "num_requests": n, "engine": eng, "hf": hf, "gflop_s": gflops, "bound": bound,
               "copy_bandwidth_gbs": bandwidth, "gemm_gflops": rates}
        if args.compile:
            row["compile"] = compare_compiled(model, tok, prompts, args.output_len, c, args.compile_repeats)
        results.append(row)
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "isas": isas(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
