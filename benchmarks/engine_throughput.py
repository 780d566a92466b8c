"""Engine output tokens/s vs HF transformers `generate`, and per-step overhead vs execute time.

Workload (issue 4): N requests, prompt P random token ids, exactly O output tokens each (greedy,
EOS ignored). The engine keeps `c` requests in flight (closed loop: a new one starts when one
finishes); HF `generate` runs the same requests in batches of `c` (left-padded), which is the
best static batching can do. Same process, same weights, same thread count.

    .venv/bin/python benchmarks/engine_throughput.py --model smollm2-135m --threads 2

Prints, per concurrency: engine tok/s, HF tok/s, the ratio, and the engine's median per-step
schedule, execute and sample(+update+detokenize) times. Also a bound: decode at batch B must
read all weights once per step, so tok/s <= B * (memory bandwidth / weight bytes); on CPU the
matmul FLOPs (2 * params per token) usually bind first, reported as achieved GFLOP/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch


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
    }


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
    ap.add_argument("--compile", action="store_true", help="also run the engine with a torch.compile'd decode")
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
    print(f"model {args.model}: {num_params / 1e6:.1f}M params fp32, threads={args.threads}, "
          f"prompt {args.prompt_len} / output {args.output_len}")
    print(f"{'conc':>4} {'reqs':>4} {'engine tok/s':>13} {'HF tok/s':>9} {'ratio':>6} {'sched ms':>9} "
          f"{'exec ms':>8} {'sample ms':>9} {'decode exec ms':>14} {'GFLOP/s':>8}")
    results = []
    for c in args.concurrency:
        n = args.num_requests_c1 if (c == 1 and args.num_requests_c1) else args.num_requests
        prompts = prompts_all[:n]
        eng = run_engine(model, tok, prompts, args.output_len, c)
        hf = None if args.skip_hf else run_hf(path, prompts, args.output_len, c)
        # 2 FLOPs per parameter per token (matmuls), prompt + output tokens, over the engine's wall time
        gflops = 2 * num_params * n * (args.prompt_len + args.output_len) / eng["wall_s"] / 1e9
        ratio = f"{eng['tok_s'] / hf['tok_s']:.2f}" if hf else "-"
        hf_s = f"{hf['tok_s']:.1f}" if hf else "-"
        print(f"{c:>4} {n:>4} {eng['tok_s']:>13.1f} {hf_s:>9} {ratio:>6} {eng['median_schedule_ms']:>9.3f} "
              f"{eng['median_execute_ms']:>8.2f} {eng['median_sample_ms']:>9.3f} "
              f"{eng['median_decode_execute_ms']:>14.2f} {gflops:>8.1f}", flush=True)
        row = {"concurrency": c, "num_requests": n, "engine": eng, "hf": hf, "gflop_s": gflops}
        if args.compile:
            row["engine_compiled"] = run_engine(model, tok, prompts, args.output_len, c, compile_decode=True)
            print(f"     compiled decode: {row['engine_compiled']['tok_s']:.1f} tok/s")
        results.append(row)
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "results": results}, indent=1))


if __name__ == "__main__":
    main()
