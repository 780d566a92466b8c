"""Speculative decoding on SmolLM2-135M: decode tokens/s and accepted tokens per step, per proposer,
at temperature 0 and 1, on a chat and a code prompt set, against no speculation in the same run.

    FIRSTLIGHT_HOME=/tmp/fl_home .venv/bin/python benchmarks/spec_decode.py --threads 2 \
        --heads /tmp/spec_heads/smollm2_heads.safetensors [--json out.json]

Runs through the continuous-batching engine (one engine per method, same weights), one request at
a time, every prompt through every method back to back; greedy or seeded sampling, fp32, medians
over prompts. Bound: a speculative step costs one target pass
over 1+k tokens plus the proposer, so the speedup cannot exceed (accepted + 1) / (t_{1+k} / t_1),
with t_n the measured time of an n-token target pass; that bound is printed next to each speedup.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

CHAT = [
    "What is the capital of France? Answer in one sentence.",
    "Give me three tips for staying focused while studying.",
    "Explain what a black hole is to a ten-year-old.",
    "Write a short poem about the sea.",
    "List the days of the week.",
    "What are the benefits of drinking water?",
    "How do I make a cup of tea?",
    "Summarize the plot of Romeo and Juliet.",
]
CODE = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Write a Python function to check whether a string is a palindrome.",
    "Write a Python class for a stack with push, pop and peek.",
    "Write a Python function that sorts a list of dictionaries by the key 'age'.",
    "Write a Python function that counts the words in a text file.",
    "Write a Python function that merges two sorted lists.",
    "Write a Python function that returns the prime numbers below n.",
    "Write a Python function that flattens a nested list.",
]


def chat_ids(tok, text: str) -> list[int]:  # noqa: ANN001
    prompt = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    return list(tok.encode(prompt, add_special_tokens=False))


def decode_one(engine, ids: list[int], params) -> tuple[int, float]:  # noqa: ANN001
    """(tokens after the first, seconds from the first token to the last) for one request alone."""
    engine.add_request(ids, params)
    t_first, n = None, 0
    while engine.has_unfinished():
        for out in engine.step():
            if t_first is None and out.new_token_ids:
                t_first = time.perf_counter()
                n -= 1  # the prefill's token is not a decode token
            n += len(out.new_token_ids)
    return n, time.perf_counter() - t_first


def pass_cost_ratio(model, k: int, context: int = 64, repeats: int = 21) -> tuple[float, float]:  # noqa: ANN001
    """Median seconds of one target pass over 1 token and over 1 + k tokens after `context` tokens
    (contiguous cache): a speculative step cannot beat (accepted + 1) / (t_{1+k} / t_1)."""
    from firstlight.models.kv_cache import ContiguousKVCache

    cfg = model.config

    def once(n: int) -> float:
        cache = ContiguousKVCache(cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim, context + n)
        with torch.inference_mode():
            model.forward_hidden(torch.ones(1, context, dtype=torch.long), torch.arange(context)[None], cache)
            t0 = time.perf_counter()
            h = model.forward_hidden(torch.ones(1, n, dtype=torch.long), torch.arange(context, context + n)[None], cache)
            model.compute_logits(h)
            return time.perf_counter() - t0

    pairs = [(once(1), once(1 + k)) for _ in range(repeats)]  # interleaved: load drift hits both
    return statistics.median(a for a, _ in pairs), statistics.median(b for _, b in pairs)


def run_set(engines: dict, prompts: list[list[int]], args, temperature: float) -> dict:  # noqa: ANN001
    """Every prompt through every engine back to back (so load drifts hit all methods alike)."""
    from firstlight.engine.request import SamplingParams

    tps: dict[str, list[float]] = {m: [] for m in engines}
    before = {m: (e.spec.stats.num_drafts, e.spec.stats.num_accepted_tokens) for m, e in engines.items() if e.spec}
    for i, ids in enumerate(prompts):
        params = SamplingParams(max_tokens=args.max_tokens, temperature=temperature, seed=i, ignore_eos=True)
        for m, engine in engines.items():
            n, dt = decode_one(engine, ids, params)
            tps[m].append(n / dt)
    rows = {}
    for m, engine in engines.items():
        acc = 0.0
        if engine.spec:
            d0, a0 = before[m]
            st = engine.spec.stats
            acc = (st.num_accepted_tokens - a0) / max(1, st.num_drafts - d0)
        rows[m] = {"decode_tok_s": statistics.median(tps[m]), "mean_accepted_per_step": acc}
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--draft-layers", type=int, default=8)
    ap.add_argument("--heads", default=None, help="heads file (default: next to the model)")
    ap.add_argument("--methods", default="none,ngram,draft,heads")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from firstlight.engine.spec.config import SpecConfig
    from firstlight.engine.spec.medusa import default_heads_path
    from firstlight.models.hub import resolve
    from firstlight.models.loader import load_model

    model_dir = resolve(args.model)
    model, tok = load_model(model_dir)
    model.eval()
    sets = {"chat": [chat_ids(tok, p) for p in CHAT[: args.num_prompts]],
            "code": [chat_ids(tok, p) for p in CODE[: args.num_prompts]]}
    heads_path = args.heads or str(default_heads_path(model_dir))
    from firstlight.engine.engine import EngineConfig, LLMEngine

    engines = {}
    for method in args.methods.split(","):
        spec = None
        if method != "none":
            spec = SpecConfig(method, num_spec_tokens=args.k, draft_layers=args.draft_layers, heads_path=heads_path)
        engines[method] = LLMEngine(model, tok, EngineConfig(speculative=spec, kv_cache_bytes=256 << 20,
                                                             enable_prefix_caching=False))
    t1, tk = pass_cost_ratio(model, args.k)
    ratio = tk / t1
    print(f"target pass: 1 token {t1 * 1e3:.1f} ms, {1 + args.k} tokens {tk * 1e3:.1f} ms (ratio {ratio:.2f}); "
          f"bound = (accepted + 1) / ratio, proposer cost excluded")
    rows = []
    print(f"model {args.model}, fp32, engine, one request at a time, threads {args.threads}, k={args.k}, "
          f"{args.max_tokens} tokens/prompt, {args.num_prompts} prompts/set; tok/s = median over prompts")
    print(f"{'method':8} {'T':>3} {'set':5} {'tok/s':>8} {'speedup':>8} {'acc/step':>9} {'bound':>6}")
    for temperature in [float(t) for t in args.temperatures.split(",")]:
        for name, prompts in sets.items():
            res = run_set(engines, prompts, args, temperature)
            base = res["none"]["decode_tok_s"] if "none" in res else float("nan")
            for method, r in res.items():
                r.update(method=method, temperature=temperature, set=name, speedup=r["decode_tok_s"] / base)
                rows.append(r)
                # bound: tokens per step / cost of a (1 + k)-token pass relative to a 1-token pass
                r["bound"] = (r["mean_accepted_per_step"] + 1) / (ratio if method != "none" else 1.0)
                print(f"{method:8} {temperature:3.0f} {name:5} {r['decode_tok_s']:8.1f} {r['speedup']:7.2f}x "
                      f"{r['mean_accepted_per_step']:9.2f} {r['bound']:5.2f}x", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "pass_s": {"1": t1, str(1 + args.k): tk}, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
