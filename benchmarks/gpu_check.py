"""Issue 15's GPU item in one call, for a session that is lent a device (nothing here runs in CI): the engine's
decode, eager and compiled over its shape buckets with CUDA graphs, against HF transformers `generate`, at
concurrency 1 / 8 / 32, on a model's own shapes with random weights (the device machine reaches no network and
its working tree travels within 64 MiB: the config and tokenizer travel, the weights are made there).

Workload (engine_throughput.py's): N requests of P random prompt ids and exactly O greedy output tokens (EOS
ignored); the engine keeps c in flight, HF `generate` runs them in static batches of c. Every engine is run once
on a warm-up copy of the workload (its compiled graphs built and CUDA graphs recorded there) and then timed on
the same engine; compile and record time is reported apart.

A dry run here, on the CPU, small (checks the script, not the GPU):

    PYTHONPATH=. .venv/bin/python benchmarks/gpu_check.py --device cpu --num-requests 4 --output-len 8 \\
        --concurrency 1 2 --out /tmp/gpu-check

On the device (see docs/PERFORMANCE.md, "The GPU check of issue 15, prepared"): pydantic and its dependencies
travel as wheels (the image has torch, transformers, tokenizers, safetensors, numpy, typer, rich),
and the model's config.json and tokenizer files in a carried folder:

    echo /.gpu/ >> .git/info/exclude; mkdir -p .gpu/whl .gpu/smollm2-135m
    cp ~/.cache/firstlight/models/smollm2-135m/{config.json,generation_config.json,tokenizer*.json} .gpu/smollm2-135m/
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_17_x86_64 -d .gpu/whl pydantic==2.14.4 pydantic-core==2.50.5 \\
        annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
    # run, carry [".gpu"]:
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/whl/*.whl && \\
    PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py --model .gpu/smollm2-135m \\
        --random-weights --device cuda --out $OUT
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import time
import traceback
from pathlib import Path

import torch
from engine_throughput import make_prompts, run_hf, sync


def random_checkpoint(src: Path, dst: Path, dtype: torch.dtype, seed: int = 0) -> Path:
    """A checkpoint dir with src's config and tokenizer files and random weights of its shapes (HF's init)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix == ".json" and f.name != "manifest.json":
            shutil.copy(f, dst / f.name)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src), dtype=dtype)
    model.save_pretrained(dst)
    return dst


def make_engine(model, tok, c: int, compiled: bool, device: torch.device):
    from firstlight.engine.engine import EngineConfig, LLMEngine

    engine = LLMEngine(model, tok, EngineConfig(block_size=16, kv_cache_bytes=2 << 30, max_num_seqs=c,
                                                max_num_batched_tokens=2048, compile_decode=compiled))
    if compiled and device.type == "cuda":
        # the compiled decode writes K/V into the pools: CUDA graphs may replay that only on fixed addresses
        for pool in engine.runner.k_pools + engine.runner.v_pools:
            torch._dynamo.mark_static_address(pool)
    return engine


def drive(engine, prompts: list[list[int]], output_len: int, c: int, device: torch.device) -> dict:
    """Closed loop of c over the prompts on an existing engine: tok/s and the decode steps' median time."""
    from firstlight.engine.request import SamplingParams

    sp = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    pending, num_out, decode_s = list(prompts), 0, []
    sync(device)
    t0 = time.perf_counter()
    while pending or engine.has_unfinished():
        while pending and engine.scheduler.num_running + engine.scheduler.num_waiting < c:
            engine.add_request(pending.pop(0), sp)
        prefill = bool(engine.scheduler.waiting) or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running)
        ts = time.perf_counter()
        for out in engine.step():  # sampled ids reach the host: the step is done on the device
            if out.finished:
                num_out += len(out.output_token_ids)
        if not prefill:
            decode_s.append(time.perf_counter() - ts)
    sync(device)
    wall = time.perf_counter() - t0
    decode_s.sort()
    return {"tok_s": num_out / wall, "wall_s": wall, "num_out": num_out,
            "median_decode_step_ms": 1e3 * decode_s[len(decode_s) // 2] if decode_s else None}


def run_ours(path: Path, prompts, output_len: int, c: int, compiled: bool, device: torch.device,
             dtype: torch.dtype) -> dict:
    from firstlight.models.loader import load_model

    model, tok = load_model(path, dtype=str(dtype).removeprefix("torch."))
    model.to(device)
    engine = make_engine(model, tok, c, compiled, device)
    t0 = time.perf_counter()
    drive(engine, prompts[:c] if compiled else prompts[:1], output_len, c, device)  # builds/records the graphs
    warm_s = time.perf_counter() - t0
    got = drive(engine, prompts, output_len, c, device)
    return got | {"warmup_s": warm_s, "decode_graphs": engine.runner.num_decode_compiles,
                  "decode_buckets_used": len(engine.runner.decode_shapes)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="model name or checkpoint dir (config + tokenizer)")
    ap.add_argument("--random-weights", action="store_true",
                    help="make random weights of the model's shapes under --work (a dir without weights needs this)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/gpu-check-model"), help="where random weights go")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--num-requests-c1", type=int, default=4, help="requests at concurrency 1")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--threads", type=int, default=8, help="torch CPU threads (the host side)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/gpu-check"))
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    if args.device.startswith("cuda"):
        import torch._inductor.config as inductor_config

        inductor_config.triton.cudagraphs = True  # the compiled decode's buckets become CUDA graphs
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    args.out.mkdir(parents=True, exist_ok=True)
    from firstlight.models.hub import resolve

    path = Path(args.model) if Path(args.model).is_dir() else resolve(args.model)
    if args.random_weights:
        path = random_checkpoint(path, args.work, dtype)
    info = {"torch": torch.__version__, "device": str(device), "dtype": args.dtype, "python": platform.python_version(),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
            "model": str(args.model), "random_weights": args.random_weights, "args": vars(args) | {"out": str(args.out), "work": str(args.work)}}
    print(json.dumps({k: v for k, v in info.items() if k != "args"}), flush=True)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    prompts_all = make_prompts(max(args.num_requests, args.num_requests_c1, *args.concurrency), args.prompt_len, vocab)
    rows = []
    print(f"{'c':>3} {'reqs':>4} {'eager tok/s':>11} {'compiled tok/s':>14} {'HF tok/s':>9} {'compiled / HF':>13} "
          f"{'eager / compiled decode step ms':>31} {'graphs':>6} {'warm-up s':>9}", flush=True)
    for c in args.concurrency:
        prompts = prompts_all[: args.num_requests_c1 if c == 1 else args.num_requests]
        row: dict = {"concurrency": c, "num_requests": len(prompts)}
        runs = (("eager", run_ours, (False, device, dtype)), ("compiled", run_ours, (True, device, dtype)),
                ("hf", run_hf, (device, dtype, True)))
        for name, fn, extra in runs:
            try:
                row[name] = fn(path, prompts, args.output_len, c, *extra)
            except Exception as e:  # one failing path must not lose the others' figures
                row[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
                print(f"  c = {c} {name}: {row[name]['error']}", flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        rows.append(row)
        print_row(row)
        (args.out / "gpu_check.json").write_text(json.dumps(info | {"results": rows}, indent=1))


def print_row(row: dict) -> None:
    def get(name: str, key: str) -> float | None:
        return row[name].get(key) if "error" not in row[name] else None

    def f(x: float | None, nd: int = 1) -> str:
        return "-" if x is None else f"{x:.{nd}f}"

    ours, hf = get("compiled", "tok_s"), get("hf", "tok_s")
    steps = " / ".join(f(get(n, "median_decode_step_ms"), 2) for n in ("eager", "compiled"))
    print(f"{row['concurrency']:>3} {row['num_requests']:>4} {f(get('eager', 'tok_s')):>11} {f(ours):>14} {f(hf):>9} "
          f"{f(ours / hf if ours and hf else None, 2):>13} {steps:>31} {f(get('compiled', 'decode_graphs'), 0):>6} "
          f"{f(get('compiled', 'warmup_s')):>9}", flush=True)


if __name__ == "__main__":
    main()
