"""Speculative decoding on SmolLM2-135M: decode tokens/s and accepted tokens per step, per proposer,
at temperature 0 and 1, on a chat, a code-generation and a code-editing prompt set, against no
speculation in the same run.

Methods: `none`, `ngram`, `draft`, `heads`, each with k = --k proposals per step, and `METHOD+aN`:
adaptive k per request (SpecConfig.adaptive_k) with at most N proposals per step, e.g. `ngram+a16`.

    FIRSTLIGHT_HOME=/tmp/fl_home .venv/bin/python benchmarks/spec_decode.py --threads 1 \
        --methods none,ngram,ngram+a16,draft,heads,heads+a4 [--heads FILE] [--json out.json]

Runs through the continuous-batching engine (one engine per method, same weights), one request at
a time, every prompt through every method back to back; greedy or seeded sampling, fp32, medians
over prompts, and total tokens / total time. Prediction: a speculative step costs one target pass
over 1+k tokens plus the proposer, a step without proposals one 1-token pass; with t_n the
measured time of an n-token pass, the pass costs predict a speedup of decode tokens / sum over
decode steps of t_(1+k) / t_1 (proposer free; the engine's fixed per-step cost, amortized over more
tokens per step, can put the measured speedup above it). It is printed next to each speedup.

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

# Code editing: the answer rewrites code given in the prompt (what coding assistants are asked most,
# and where prompt lookup is known to pay, Saxena 2023). The 135M model mostly copies the code back.
CODE_EDIT = [
    ("Add type hints to this Python function and return the full function:\n\n```python\n"
     "def merge_sorted(a, b):\n    result = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
     "        if a[i] <= b[j]:\n            result.append(a[i])\n            i += 1\n        else:\n"
     "            result.append(b[j])\n            j += 1\n    result.extend(a[i:])\n    result.extend(b[j:])\n"
     "    return result\n```"),
    ("Add type hints to this Python function and return the full function:\n\n```python\n"
     "def count_words(path):\n    counts = {}\n    with open(path) as f:\n        for line in f:\n"
     "            for word in line.split():\n                word = word.lower().strip('.,;:!?')\n"
     "                counts[word] = counts.get(word, 0) + 1\n    return counts\n```"),
    ("Add comments to this Python function and return the full function:\n\n```python\n"
     "def flatten(items):\n    out = []\n    for x in items:\n        if isinstance(x, list):\n"
     "            out.extend(flatten(x))\n        else:\n            out.append(x)\n    return out\n```"),
    ("Add type hints to this Python function and return the full function:\n\n```python\n"
     "def read_config(path):\n    config = {}\n    with open(path) as f:\n        for line in f:\n"
     "            line = line.strip()\n            if not line or line.startswith('#'):\n                continue\n"
     "            key, value = line.split('=', 1)\n            config[key.strip()] = value.strip()\n    return config\n```"),
    ("Add comments to this class and return the full class:\n\n```python\n"
     "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
     "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n\n"
     "    def peek(self):\n        return self.items[-1]\n\n    def is_empty(self):\n        return not self.items\n```"),
    ("Add type hints to this Python function and return the full function:\n\n```python\n"
     "def primes_below(n):\n    primes = []\n    for candidate in range(2, n):\n        is_prime = True\n"
     "        for p in primes:\n            if p * p > candidate:\n                break\n"
     "            if candidate % p == 0:\n                is_prime = False\n                break\n"
     "        if is_prime:\n            primes.append(candidate)\n    return primes\n```"),
    ("Add comments to this class and return the full class:\n\n```python\n"
     "class Counter:\n    def __init__(self, start=0):\n        self.value = start\n\n    def increment(self, step=1):\n"
     "        self.value += step\n        return self.value\n\n    def reset(self):\n        self.value = 0\n\n"
     "    def __repr__(self):\n        return f'Counter({self.value})'\n```"),
    ("Add type hints to this Python function and return the full function:\n\n```python\n"
     "def binary_search(items, target):\n    low, high = 0, len(items) - 1\n    while low <= high:\n"
     "        mid = (low + high) // 2\n        if items[mid] == target:\n            return mid\n"
     "        if items[mid] < target:\n            low = mid + 1\n        else:\n            high = mid - 1\n"
     "    return -1\n```"),
]


def chat_ids(tok, text: str) -> list[int]:  # noqa: ANN001
    prompt = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    return list(tok.encode(prompt, add_special_tokens=False))


def decode_one(engine, ids: list[int], params, cost=None) -> tuple[int, float, float]:  # noqa: ANN001
    """(tokens after the first, seconds from the first token to the last, passes in units of a
    1-token pass: sum over decode steps of cost(1 + proposals verified)) for one request alone."""
    engine.add_request(ids, params)
    t_first, n, units = None, 0, 0.0
    while engine.has_unfinished():
        outs = engine.step()
        if t_first is not None:
            k = engine.spec.last_step.get("num_draft_tokens", 0) if engine.spec else 0
            units += cost(1 + k) if cost else 1.0
        for out in outs:
            if t_first is None and out.new_token_ids:
                t_first = time.perf_counter()
                n -= 1  # the prefill's token is not a decode token
            n += len(out.new_token_ids)
    return n, time.perf_counter() - t_first, units


def parse_method(label: str, k: int) -> tuple[str, int, bool]:
    """`ngram` -> (ngram, k, fixed); `ngram+a16` -> (ngram, 16, adaptive)."""
    name, _, opt = label.partition("+")
    if opt:
        if not opt.startswith("a") or not opt[1:].isdigit():
            raise SystemExit(f"method {label!r}: expected NAME or NAME+aN (adaptive k, at most N)")
        return name, int(opt[1:]), True
    return name, k, False


def run_set(engines: dict, prompts: list[list[int]], args, temperature: float, cost=None) -> dict:  # noqa: ANN001
    """Every prompt through every engine back to back (so load drifts hit all methods alike)."""
    from firstlight.engine.request import SamplingParams

    tps: dict[str, list[float]] = {m: [] for m in engines}
    tokens = dict.fromkeys(engines, 0)
    units = dict.fromkeys(engines, 0.0)
    seconds = dict.fromkeys(engines, 0.0)
    before = {m: (e.spec.stats.num_drafts, e.spec.stats.num_accepted_tokens, e.spec.stats.num_draft_tokens)
              for m, e in engines.items() if e.spec}
    for i, ids in enumerate(prompts):
        params = SamplingParams(max_tokens=args.max_tokens, temperature=temperature, seed=i, ignore_eos=True)
        for m, engine in engines.items():
            n, dt, u = decode_one(engine, ids, params, cost)
            tps[m].append(n / dt)
            tokens[m] += n
            units[m] += u
            seconds[m] += dt
    rows = {}
    for m, engine in engines.items():
        acc = proposed = 0.0
        drafts = 0
        if engine.spec:
            d0, a0, p0 = before[m]
            st = engine.spec.stats
            drafts = st.num_drafts - d0
            acc = (st.num_accepted_tokens - a0) / max(1, drafts)
            proposed = (st.num_draft_tokens - p0) / max(1, drafts)
        rows[m] = {"decode_tok_s": statistics.median(tps[m]), "decode_tok_s_per_prompt": tps[m],
                   "decode_tok_s_all": tokens[m] / seconds[m],
                   "decode_tokens": tokens[m], "num_drafts": drafts, "pass_units": units[m],
                   "predicted_speedup": tokens[m] / units[m] if units[m] else float("nan"),
                   "mean_accepted_per_step": acc, "mean_proposed_per_step": proposed}
    return rows


def draft_batch(model, tok, args) -> list[dict]:  # noqa: ANN001
    """Median proposal ms per engine step, old (per request) vs new (batched), per concurrency."""
    from firstlight.engine.engine import EngineConfig, LLMEngine
    from firstlight.engine.request import SamplingParams
    from firstlight.engine.speculative.config import SpecConfig
    from firstlight.engine.speculative.draft import DraftProposer

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
    ap.add_argument("--sets", default="chat,code,code-edit", help="prompt sets: chat, code (generation), code-edit")
    ap.add_argument("--json", default=None)
    ap.add_argument("--draft-batch", default=None, metavar="CONCURRENCIES",
                    help="e.g. 1,8,16: only time the draft proposer, per request vs batched")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from firstlight.engine.speculative.config import SpecConfig
    from firstlight.engine.speculative.medusa import default_heads_path
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
    all_sets = {"chat": CHAT, "code": CODE, "code-edit": CODE_EDIT}
    sets = {name: [chat_ids(tok, p) for p in all_sets[name][: args.num_prompts]] for name in args.sets.split(",")}
    heads_path = args.heads or str(default_heads_path(model_dir))
    from firstlight.engine.engine import EngineConfig, LLMEngine
    from firstlight.engine.speculative.adaptive import interpolate_costs, time_passes

    methods = {label: parse_method(label, args.k) for label in args.methods.split(",") if label != "none"}
    max_k = max([k for _, k, _ in methods.values()] + [args.k])
    costs = time_passes(model, sorted({1, 2, 3, 5, 9, 1 + max_k}), context=128, repeats=15)
    table = interpolate_costs(costs, max_k)  # c(1 + k), k = 0 .. max_k: the bound's and the adaptive policy's
    print("target pass over n tokens (128-token context), median ms and ratio to n = 1: "
          + ", ".join(f"n={n}: {t * 1e3:.1f} ({t / costs[1]:.2f})" for n, t in costs.items()))
    print("pred = decode tokens / sum over decode steps of t_(1+k)/t_1 (k = proposals verified in the step): the "
          "speedup the pass costs predict with a free proposer (the engine's fixed cost per step, amortized over "
          "more tokens per step, can put the measured one above it)")
    engines = {}
    for label in args.methods.split(","):
        spec = None
        if label != "none":
            method, k, adaptive = methods[label]
            spec = SpecConfig(method, num_spec_tokens=k, adaptive_k=adaptive, draft_layers=args.draft_layers,
                              heads_path=heads_path, pass_costs=tuple(table[: k + 1]) if adaptive else None)
        engines[label] = LLMEngine(model, tok, EngineConfig(speculative=spec, kv_cache_bytes=256 << 20,
                                                            enable_prefix_caching=False))
    rows = []
    print(f"model {args.model}, fp32, engine, one request at a time, threads {args.threads}, k={args.k} unless +aN, "
          f"{args.max_tokens} tokens/prompt, {args.num_prompts} prompts/set; tok/s = median over prompts")
    print("speedup = median tok/s over prompts / none's; all = total tokens / total time, / none's")
    print(f"{'method':10} {'T':>3} {'set':9} {'tok/s':>8} {'speedup':>8} {'all':>6} {'k/step':>7} {'acc/step':>9} "
          f"{'pred':>6}")
    for temperature in [float(t) for t in args.temperatures.split(",")]:
        for name, prompts in sets.items():
            res = run_set(engines, prompts, args, temperature, lambda n: table[n - 1])
            base = res["none"]["decode_tok_s"] if "none" in res else float("nan")
            for method, r in res.items():
                r.update(method=method, temperature=temperature, set=name, speedup=r["decode_tok_s"] / base,
                         speedup_all=r["decode_tok_s_all"] / res["none"]["decode_tok_s_all"] if "none" in res else None)
                rows.append(r)
                print(f"{method:10} {temperature:3.0f} {name:9} {r['decode_tok_s']:8.1f} {r['speedup']:7.2f}x "
                      f"{r['speedup_all'] or float('nan'):5.2f}x {r['mean_proposed_per_step']:7.2f} {r['mean_accepted_per_step']:9.2f} {r['predicted_speedup']:5.2f}x", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "pass_s": costs, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
