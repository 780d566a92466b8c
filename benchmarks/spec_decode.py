"""Speculative decoding on SmolLM2-135M: decode tokens/s and accepted tokens per step, per proposer,
at temperature 0 and 1, on a chat and a code prompt set, against no speculation in the same run.

    FIRSTLIGHT_HOME=/tmp/fl_home .venv/bin/python benchmarks/spec_decode.py --threads 2 \
        --heads /tmp/spec_heads/smollm2_heads.safetensors [--json out.json]

Runs through the continuous-batching engine (one engine per method, same weights), one request at
a time, every prompt through every method back to back; greedy or seeded sampling, fp32, medians
over prompts. Bound: a speculative step costs one target pass
over 1+k tokens plus the proposer, so the speedup cannot exceed (accepted + 1) / (t_{1+k} / t_1),
with t_n the measured time of an n-token target pass; that bound is printed next to each speedup.

`--draft-batch 1,8,16` instead measures the draft proposer's time per engine step at those
concurrencies, request-by-request (`DraftProposer(batched=False)`) vs batched, both called on the
same requests in every step of one engine run (greedy, order alternating per step):

    FIRSTLIGHT_HOME=/tmp/fl_home .venv/bin/python benchmarks/spec_decode.py --threads 1 --draft-batch 1,8,16
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


def draft_batch(model, tok, args) -> list[dict]:  # noqa: ANN001
    """Median proposal ms per engine step, old (per request) vs new (batched), per concurrency."""
    from firstlight.engine.engine import EngineConfig, LLMEngine
    from firstlight.engine.request import SamplingParams
    from firstlight.engine.spec.config import SpecConfig
    from firstlight.engine.spec.draft import DraftProposer

    prompts = [chat_ids(tok, p) for p in CHAT + CODE]
    # Bounds: a draft step reads the draft's weights (its layers + the LM head) once per forward: the
    # per-request path c times per step, the batched one once; batched, the step does 2 * params FLOPs
    # per row (matmul FLOPs, attention and catch-up prefill left out).
    num_params = sum(p.numel() for p in model.layers[: args.draft_layers].parameters()) + model.lm_head.weight.numel()
    weight_bytes = num_params * next(model.parameters()).element_size()
    rows = []
    print(f"draft proposer, self-draft {args.draft_layers} layers ({num_params / 1e6:.1f} M params, "
          f"{weight_bytes / 1e6:.0f} MB), k={args.k}, threads {args.threads}, greedy, {args.max_tokens} tokens/request; "
          "ms per engine step = median over steps (both on the same requests)")
    print(f"{'conc':>4} {'steps':>5} {'rows/step':>9} {'per-request ms':>14} {'batched ms':>10} {'speedup':>8} "
          f"{'bound':>6} {'per-req GB/s':>12} {'batched GFLOP/s':>15} {'same tokens':>11}")
    for conc in [int(c) for c in args.draft_batch.split(",")]:
        spec = SpecConfig("draft", num_spec_tokens=args.k, draft_layers=args.draft_layers)
        engine = LLMEngine(model, tok, EngineConfig(speculative=spec, kv_cache_bytes=256 << 20,
                                                    enable_prefix_caching=False))
        new = engine.spec.proposer
        old = DraftProposer(new.draft, batched=False)
        batched_propose, batched_free = new.propose, new.free
        times: dict[str, list[float]] = {"old": [], "new": []}
        num_rows, num_same = [], 0

        def timed_propose(reqs, old=old, batched_propose=batched_propose, times=times, num_rows=num_rows):  # noqa: ANN001, ANN202
            nonlocal num_same
            order = [("old", old.propose), ("new", batched_propose)]
            out = {}
            for name, fn in order if len(num_rows) % 2 else order[::-1]:  # alternate: drift hits both
                t0 = time.perf_counter()
                out[name] = fn(reqs)
                times[name].append(time.perf_counter() - t0)
            num_rows.append(len(reqs))
            num_same += [p.token_ids for p in out["old"]] == [p.token_ids for p in out["new"]]
            return out["new"]

        new.propose = timed_propose  # instance attributes: the engine's decoder calls these
        new.free = lambda rid, old=old, batched_free=batched_free: (batched_free(rid), old.free(rid))
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        for i in range(conc):
            engine.add_request(prompts[i % len(prompts)], params)
        while engine.has_unfinished():
            engine.step()
        engine.close()
        t_old, t_new = statistics.median(times["old"]) * 1e3, statistics.median(times["new"]) * 1e3
        rows_med = statistics.median(num_rows)
        old_gb_s = rows_med * args.k * weight_bytes / (t_old * 1e-3) / 1e9  # weights streamed per request
        new_gflop_s = rows_med * args.k * 2 * num_params / (t_new * 1e-3) / 1e9
        row = {"concurrency": conc, "num_steps": len(num_rows), "median_rows_per_step": rows_med,
               "per_request_ms": t_old, "batched_ms": t_new, "speedup": t_old / t_new, "bound": rows_med,
               "per_request_weight_gb_s": old_gb_s, "batched_gflop_s": new_gflop_s, "same_tokens_steps": num_same}
        rows.append(row)
        print(f"{conc:4d} {len(num_rows):5d} {rows_med:9.0f} {t_old:14.1f} {t_new:10.1f} {t_old / t_new:7.2f}x "
              f"{rows_med:5.0f}x {old_gb_s:12.1f} {new_gflop_s:15.1f} {num_same:5d}/{len(num_rows)}", flush=True)
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
    ap.add_argument("--draft-batch", default=None, metavar="CONCURRENCIES",
                    help="e.g. 1,8,16: only time the draft proposer, per request vs batched")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from firstlight.engine.spec.config import SpecConfig
    from firstlight.engine.spec.medusa import default_heads_path
    from firstlight.models.hub import resolve
    from firstlight.models.loader import load_model

    model_dir = resolve(args.model)
    model, tok = load_model(model_dir)
    model.eval()
    if args.draft_batch:
        rows = draft_batch(model, tok, args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "draft_batch": rows}, f, indent=2)
        return
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
