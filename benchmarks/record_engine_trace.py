"""Record an engine trace (steps + per-request lines) under a chosen load, for `sim calibrate` / `sim serve --trace`.

Random token-id prompts (no prefix-cache hits), exact output lengths (EOS ignored), greedy. Load is
either closed-loop (`--concurrency C`: a new request starts when one finishes) or open-loop Poisson
(`--rate R` requests/s on the wall clock; the engine idles until the next arrival). Lengths are
uniform in the given ranges. One torch thread unless `--threads`.

    .venv/bin/python benchmarks/record_engine_trace.py --model smollm2-135m --concurrency 4 \
        --num-requests 16 --prompt-len 32:256 --output-len 8:48 --out docs/calibration/smollm2-c4.jsonl.gz
    .venv/bin/python benchmarks/record_engine_trace.py --model tiny --rate 20 --num-requests 60 --out t.jsonl.gz

`--model tiny` writes a random-weight Llama-style checkpoint (hidden 256, 4 layers, vocab 4096) to a
temporary directory first; its config.json is copied next to the trace as `<out>.config.json`.
"""

from __future__ import annotations

import argparse
import gzip
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

TINY = {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 4096, "max_position_embeddings": 2048}


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


def drive(engine, prompts: list[list[int]], outputs: list[int], concurrency: int | None = None,
          rate: float | None = None, seed: int = 0) -> float:
    """Feed the requests closed-loop (`concurrency`) or open-loop Poisson (`rate`); returns wall seconds."""
    from firstlight.engine.request import SamplingParams

    n = len(prompts)
    arrivals = np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate, n)) if rate else None
    t0 = time.perf_counter()
    nxt = 0
    while nxt < n or engine.has_unfinished():
        now = time.perf_counter() - t0
        while nxt < n and (arrivals[nxt] <= now if arrivals is not None
                           else len(engine.scheduler.requests) < (concurrency or 1)):
            engine.add_request(prompts[nxt], SamplingParams(max_tokens=outputs[nxt], temperature=0.0, ignore_eos=True))
            nxt += 1
        if engine.has_unfinished():
            engine.step()
        elif arrivals is not None and nxt < n:
            time.sleep(max(0.0, arrivals[nxt] - (time.perf_counter() - t0)))
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="a pulled model name, a checkpoint dir, or `tiny`")
    load = ap.add_mutually_exclusive_group(required=True)
    load.add_argument("--concurrency", type=int, help="requests kept in flight (closed loop)")
    load.add_argument("--rate", type=float, help="Poisson arrivals per second (open loop)")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--prompt-len", default="32:256", help="LO:HI uniform prompt tokens")
    ap.add_argument("--output-len", default="8:48", help="LO:HI uniform output tokens")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True, help="trace path (.jsonl or .jsonl.gz)")
    args = ap.parse_args()

    from firstlight.engine.engine import EngineConfig, LLMEngine
    from firstlight.models.loader import load_model

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path: Path | str = args.model
        if args.model == "tiny":
            from firstlight.models.tiny import write_tiny_checkpoint

            path = write_tiny_checkpoint(Path(tmp) / "tiny", "llama", seed=args.seed, **TINY)
        else:
            from firstlight.models.hub import resolve

            path = resolve(args.model)
        model, tok = load_model(path)
        raw = Path(tmp) / "trace.jsonl"
        engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=args.max_num_seqs, trace_path=raw,
                                                    max_num_batched_tokens=args.max_num_batched_tokens))
        rng = np.random.default_rng(args.seed)
        vocab = model.config.vocab_size
        p_lo, p_hi = _range(args.prompt_len)
        o_lo, o_hi = _range(args.output_len)
        plens = rng.integers(p_lo, p_hi + 1, args.num_requests)
        prompts = [rng.integers(10, vocab - 10, int(n)).tolist() for n in plens]
        outputs = rng.integers(o_lo, o_hi + 1, args.num_requests).tolist()
        wall = drive(engine, prompts, outputs, args.concurrency, args.rate, args.seed)
        engine.close()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        if args.out.suffix == ".gz":
            with open(raw, "rb") as src, gzip.open(args.out, "wb") as dst:
                shutil.copyfileobj(src, dst)
        else:
            shutil.copy(raw, args.out)
        stem = args.out.name.removesuffix(".gz").removesuffix(".jsonl")  # keep dots in the name (smollm2-r0.5)
        cfg_out = args.out.with_name(stem + ".config.json")
        shutil.copy(Path(path) / "config.json", cfg_out)
    load_txt = f"concurrency {args.concurrency}" if args.concurrency else f"rate {args.rate}/s"
    print(f"{args.num_requests} requests ({load_txt}) in {wall:.1f} s; trace {args.out}; model config {cfg_out}")


if __name__ == "__main__":
    main()
