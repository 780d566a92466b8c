"""Engine output tokens/s vs HF transformers `generate`, and per-step overhead vs execute time.

Workload (issue 4): N requests, prompt P random token ids, exactly O output tokens each (greedy,
EOS ignored). The engine keeps `c` requests in flight (closed loop: a new one starts when one
finishes); HF `generate` runs the same requests in batches of `c` (left-padded), which is the
best static batching can do. Same process, same weights, same thread count.

    .venv/bin/python benchmarks/engine_throughput.py --model smollm2-135m --threads 2

Prints, per concurrency: engine tok/s, HF tok/s, the ratio, and the engine's median per-step
schedule, execute and sample(+update+detokenize) times, next to a hardware bound on output tok/s
for the same workload (see `workload_bound`): prefill at the measured GEMM rate, then decode steps
at batch c that each cost max(FLOPs / GEMM rate, weight bytes / copy bandwidth), with FLOPs =
2 x matmul params per token (Kaplan et al. 2020) + 4 x context x heads x head_dim per layer
(QK^T and PV). `--compile` adds, per concurrency, eager vs torch.compile'd shape-bucketed decode: alternating runs
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
from _common import copy_bandwidth_gbs, gemm_gflops


def make_prompts(num: int, prompt_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (num, prompt_len), generator=g).tolist()


def run_engine(model, tok, prompts, output_len, concurrency, compile_decode=False) -> dict:
    from firstlight.core.trace import Trace
    from firstlight.engine.engine import EngineConfig, LLMEngine
    from firstlight.engine.request import SamplingParams

    sp = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    with tempfile.TemporaryDirectory() as d:
        trace_path = Path(d) / "trace.jsonl"
        cfg = EngineConfig(block_size=16, kv_cache_bytes=2 << 30, max_num_seqs=concurrency,
                           max_num_batched_tokens=2048, compile_decode=compile_decode, trace_path=trace_path)
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


def matmul_params(model: torch.nn.Module) -> int:
    """Parameters that go through a matmul per token: every Linear (the embedding is a row lookup,
    unless it is tied to the LM head, which is a Linear sharing its weight)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def workload_bound(model, num_requests: int, prompt_len: int, output_len: int, concurrency: int,
                   prefill_gflop_s: float, decode_gflop_s: float, bandwidth_gbs: float) -> dict:
    """Output tok/s no implementation can beat on this machine for the workload (lower time bound).

    Prefill: FLOPs / GEMM rate at M = prompt_len. Decode: num_requests * output_len / c steps at batch c,
    each max(FLOPs / GEMM rate at M = c, weight bytes / copy bandwidth): a step reads every weight once
    (roofline, Williams et al. 2009). Attention FLOPs use the mean context of each phase.
    """
    cfg = model.config
    params = matmul_params(model)
    weight_bytes = params * next(model.parameters()).element_size()
    attn_per_token = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim  # x context length
    prefill_flops = num_requests * prompt_len * (2 * params + attn_per_token * prompt_len / 2)
    decode_flops = num_requests * output_len * (2 * params + attn_per_token * (prompt_len + output_len / 2))
    num_steps = num_requests * output_len / concurrency
    compute_s = decode_flops / (decode_gflop_s * 1e9)
    memory_s = num_steps * weight_bytes / (bandwidth_gbs * 1e9)
    total_s = prefill_flops / (prefill_gflop_s * 1e9) + max(compute_s, memory_s)
    return {"tok_s": num_requests * output_len / total_s, "decode_bound_by": "compute" if compute_s > memory_s else
            "memory", "decode_compute_s": compute_s, "decode_memory_s": memory_s, "weight_bytes": weight_bytes,
            "prefill_gflop": prefill_flops / 1e9, "decode_gflop": decode_flops / 1e9}


def run_hf(path: Path, prompts, output_len, batch_size) -> dict:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
    num_out = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch_size):
            chunk = prompts[i : i + batch_size]  # equal lengths: no padding needed
            ids = torch.tensor(chunk)
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                              min_new_tokens=output_len, do_sample=False, pad_token_id=pad)
            num_out += (out.shape[1] - ids.shape[1]) * out.shape[0]
    wall = time.perf_counter() - t0
    return {"tok_s": num_out / wall, "wall_s": wall}


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
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    from firstlight.models.hub import resolve
    from firstlight.models.loader import load_model

    path = resolve(args.model)
    model, tok = load_model(path)
    cfg = model.config
    num_params = sum(p.numel() for p in model.parameters())
    prompts_all = make_prompts(args.num_requests, args.prompt_len, cfg.vocab_size)
    run_engine(model, tok, prompts_all[:2], 4, 2)  # warm-up
    bandwidth = copy_bandwidth_gbs()
    prefill_rate = gemm_gflops(args.prompt_len, cfg.hidden_size, cfg.intermediate_size)
    print(f"model {args.model}: {num_params / 1e6:.1f}M params fp32 ({matmul_params(model) / 1e6:.1f}M in matmuls), "
          f"threads={args.threads}, prompt {args.prompt_len} / output {args.output_len}")
    print(f"machine: copy bandwidth {bandwidth:.1f} GB/s, GEMM {prefill_rate:.1f} GFLOP/s at "
          f"[{args.prompt_len}, {cfg.hidden_size}] x [{cfg.hidden_size}, {cfg.intermediate_size}]")
    print(f"{'conc':>4} {'reqs':>4} {'engine tok/s':>13} {'HF tok/s':>9} {'ratio':>6} {'bound tok/s':>11} "
          f"{'eng %':>6} {'HF %':>5} {'sched ms':>9} {'exec ms':>8} {'sample ms':>9} {'decode exec ms':>14} "
          f"{'GFLOP/s':>8}")
    results = []
    for c in args.concurrency:
        n = args.num_requests_c1 if (c == 1 and args.num_requests_c1) else args.num_requests
        prompts = prompts_all[:n]
        eng = run_engine(model, tok, prompts, args.output_len, c)
        hf = None if args.skip_hf else run_hf(path, prompts, args.output_len, c)
        bound = workload_bound(model, n, args.prompt_len, args.output_len, c, prefill_rate,
                               gemm_gflops(c, cfg.hidden_size, cfg.intermediate_size), bandwidth)
        # 2 FLOPs per parameter per token (matmuls), prompt + output tokens, over the engine's wall time
        gflops = 2 * num_params * n * (args.prompt_len + args.output_len) / eng["wall_s"] / 1e9
        ratio = f"{eng['tok_s'] / hf['tok_s']:.2f}" if hf else "-"
        hf_s = f"{hf['tok_s']:.1f}" if hf else "-"
        hf_pct = f"{100 * hf['tok_s'] / bound['tok_s']:.0f}" if hf else "-"
        print(f"{c:>4} {n:>4} {eng['tok_s']:>13.1f} {hf_s:>9} {ratio:>6} {bound['tok_s']:>11.1f} "
              f"{100 * eng['tok_s'] / bound['tok_s']:>6.0f} {hf_pct:>5} {eng['median_schedule_ms']:>9.3f} "
              f"{eng['median_execute_ms']:>8.2f} {eng['median_sample_ms']:>9.3f} "
              f"{eng['median_decode_execute_ms']:>14.2f} {gflops:>8.1f}   (decode {bound['decode_bound_by']}-bound)",
              flush=True)
        row = {"concurrency": c, "num_requests": n, "engine": eng, "hf": hf, "gflop_s": gflops, "bound": bound}
        if args.compile:
            row["compile"] = compare_compiled(model, tok, prompts, args.output_len, c, args.compile_repeats)
        results.append(row)
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "results": results}, indent=1))


if __name__ == "__main__":
    main()
