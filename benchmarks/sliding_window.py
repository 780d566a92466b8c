"""Gemma 3's decode step vs context length, with sliding-window layers keeping only their window
(`EngineConfig.free_out_of_window`, the default) and without (every layer gathers the whole context).

    PYTHONPATH=. .venv/bin/python benchmarks/sliding_window.py --model gemma3-270m --threads 1 \
        --contexts 512,2048,8192

Per context length: one request whose prompt fills the context (random ids), then decode steps; the
median execute time of 8 decode steps per mode, modes alternating (same process, same weights), and the
KV blocks the request holds on the local (sliding) and global layers. The KV bytes a decode step reads
(the bound on the KV part of the step): global layers read the context, local layers min(context, W).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def decode_ms(model, tok, context: int, evict: bool, steps: int) -> tuple[float, int, int]:
    from firstlight.engine.engine import EngineConfig, LLMEngine
    from firstlight.engine.request import SamplingParams

    cfg = EngineConfig(block_size=16, kv_cache_bytes=2 << 30, max_num_seqs=1, max_num_batched_tokens=2048,
                       free_out_of_window=evict)
    engine = LLMEngine(model, tok, cfg)
    g = torch.Generator().manual_seed(context)
    prompt = torch.randint(10, model.config.vocab_size - 10, (context,), generator=g).tolist()
    req = engine.add_request(prompt, SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True))
    while req.num_computed_tokens < context:
        engine.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    kv = engine.kv
    local = kv.sliding.num_held_blocks(req.request_id) if hasattr(kv, "sliding") else kv.num_held_blocks(req.request_id)
    full = kv.num_held_blocks(req.request_id)
    engine.abort_request(req.request_id)
    return 1e3 * statistics.median(times), local, full


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--contexts", default="512,2048,8192")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from firstlight.models import hub
    from firstlight.models.loader import load_model

    model, tok = load_model(hub.resolve(args.model))
    cfg = model.config
    local_layers = sum(1 for i in cfg.kv_layers if cfg.window(i))
    print(f"{args.model}: {len(cfg.kv_layers)} attention layers, {local_layers} sliding (window {cfg.sliding_window}), "
          f"{args.threads} thread(s), load average {os.getloadavg()[0]:.1f}; median of {args.rounds} x {args.steps} "
          "decode steps per mode, modes alternating")
    per_token = 2 * cfg.num_kv_heads * cfg.head_dim * next(model.parameters()).element_size()  # K + V, one layer
    print("| context | step ms, window kept | step ms, whole context | ratio | local / global blocks held | "
          "KV MB read per step, window / whole |")
    print("|---:|---:|---:|---:|---|---:|")
    for context in (int(c) for c in args.contexts.split(",")):
        runs: dict[bool, list[float]] = {True: [], False: []}
        held = {}
        for _ in range(args.rounds):
            for evict in (True, False):
                ms, local, full = decode_ms(model, tok, context, evict, args.steps)
                runs[evict].append(ms)
                held[evict] = (local, full)
        on, off = statistics.median(runs[True]), statistics.median(runs[False])
        kv_on = per_token * ((len(cfg.kv_layers) - local_layers) * context + local_layers * min(context, cfg.sliding_window))
        kv_off = per_token * len(cfg.kv_layers) * context
        print(f"| {context} | {on:.1f} | {off:.1f} | {off / on:.2f}x | {held[True][0]} / {held[True][1]} "
              f"(off: {held[False][1]} / {held[False][1]}) | {kv_on / 1e6:.1f} / {kv_off / 1e6:.1f} |")


if __name__ == "__main__":
    main()
