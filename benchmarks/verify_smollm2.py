"""Wall time of `verify` on SmolLM2-135M with a planted fault in layer 20 of 30, next to its bound:
two plain forward passes (reference + target) of the same token sequence. Goal: under 3x.

    FIRSTLIGHT_HOME=... .venv/bin/python benchmarks/verify_smollm2.py --threads 1 --repeats 3

Three verify runs per sequence: no continuation (25 tokens); the default 16-token greedy
continuation cold (`reference_cache=None`: the reference runs `generate`, 16 sequential decode
steps); and the same warm (the continuation from the reference cache, as in a bring-up loop that
verifies again against the same reference; the cache lives in a temp dir, filled by the warm-up).
The HF reference and a fresh copy of our model (the target consumes it: `prepare` hooks it) are
loaded before each timed run, outside the timed region, as the baseline's two models are. Each
repeat times the baseline, the reference's `generate` alone, and the verify runs back to back
(same load on a shared machine); prints medians, ratios, and the median time of each verify stage.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import memory_bandwidth_gbs  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=16, help="greedy continuation of the cold/warm runs")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from firstlight.models.hub import resolve
    from firstlight.models.loader import load_model, load_tokenizer
    from firstlight.targets.faulty import Fault, FaultyTarget
    from firstlight.verify.harness import DEFAULT_PROMPT, VerifyConfig, load_reference, run_verify
    from firstlight.verify.refcache import ContinuationCache

    path = resolve("smollm2-135m")
    ref = load_reference(path)
    ours, _ = load_model(path, with_tokenizer=False)
    prompt = load_tokenizer(path)(DEFAULT_PROMPT)["input_ids"]
    cache = ContinuationCache(Path(tempfile.mkdtemp(prefix="verify-cache-")))

    def verify(new_tokens: int, cached: bool, paths: bool = True):  # -> (seconds, VerifyResult)
        fault = Fault("scale", op="aten.silu", layer=20, value=1.2)
        model, _ = load_model(path, with_tokenizer=False)  # untimed: the target consumes its model
        serving = {} if paths else {"decode_steps": 0, "batch_path": False}
        t0 = time.perf_counter()
        res = run_verify(path, FaultyTarget(faults=[fault]), "faulty", prompt,
                         VerifyConfig(new_tokens=new_tokens, ppl_tokens=0, **serving), reference=ref, model=model,
                         reference_cache=cache if cached else None)
        return time.perf_counter() - t0, res

    def generate(new_tokens: int) -> None:
        ref.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                     eos_token_id=None, pad_token_id=0)

    n = args.new_tokens
    # Each mode: (new tokens, reference cache, serving paths). The last mode is the verify of before
    # the serving paths (full-sequence units, parity and tables only), timed in the same repeat.
    modes = {"no continuation": (0, False, True), f"{n}-token continuation, cold": (n, False, True),
             f"{n}-token continuation, warm (cached)": (n, True, True),
             f"{n}-token, warm, no serving paths": (n, True, False)}
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; torch threads {args.threads}; "
          f"medians of {args.repeats} repeats")
    seqs = {}
    for new_tokens, cached, paths in modes.values():  # warm-up; checks the fault is found; fills the cache
        _, res = verify(new_tokens, cached, paths)
        assert res.culprit and res.culprit["module"] == "layers.20.mlp", res.culprit
        seqs[new_tokens] = torch.tensor([res.tokens])
    times: dict[str, list[float]] = {k: [] for k in (*modes, "base 0", f"base {n}", "generate")}
    stages: dict[str, list[dict[str, float]]] = {k: [] for k in modes}
    sources: dict[str, str] = {}
    for _ in range(args.repeats):
        for new_tokens, seq in seqs.items():
            t0 = time.perf_counter()
            with torch.no_grad():
                ref(seq)
                ours(seq)
            times[f"base {new_tokens}"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        with torch.no_grad():
            generate(n)
        times["generate"].append(time.perf_counter() - t0)
        for name, (new_tokens, cached, paths) in modes.items():
            t, res = verify(new_tokens, cached, paths)
            times[name].append(t)
            stages[name].append(res.timings_s)
            sources[name] = f"{res.reference_continuation['source']} (cache: {res.reference_continuation['cache']})"
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"culprit {res.culprit['op']} in {res.culprit['module']} at {res.culprit['source']}")
    print(f"{'run':<36} {'seq':>4} {'verify s':>9} {'2 fwd s':>8} {'ratio':>6}  goal < 3x   continuation")
    for name, (new_tokens, _, _) in modes.items():
        ratio = med[name] / med[f"base {new_tokens}"]
        print(f"{name:<36} {seqs[new_tokens].shape[1]:>4} {med[name]:>9.2f} {med[f'base {new_tokens}']:>8.2f} "
              f"{ratio:>5.2f}x  {'met' if ratio < 3 else 'NOT met':<9}  {sources[name]}")
    # The cold run's extra: `n` sequential decode steps, each reading every weight once.
    weight_bytes = sum(p.numel() * p.element_size() for p in ref.parameters())
    bw = memory_bandwidth_gbs()
    print(f"reference generate ({n} tokens) alone: {med['generate']:.2f} s; memory bound {n} steps x "
          f"{weight_bytes / 1e9:.2f} GB weights / {bw:.1f} GB/s memory bandwidth = {n * weight_bytes / bw / 1e9:.2f} s")
    cold = f"{n}-token continuation, cold"
    print(f"cold with the generation in the bound: {med[cold]:.2f} s vs "
          f"{med[f'base {n}'] + med['generate']:.2f} s = {med[cold] / (med[f'base {n}'] + med['generate']):.2f}x")
    warm, off = f"{n}-token continuation, warm (cached)", f"{n}-token, warm, no serving paths"
    print(f"serving paths (chunked prefill of 3 prompts + 2 decode steps, tables, K/V) cost "
          f"{med[warm] - med[off]:.2f} s: warm verify {med[warm] / med[off]:.2f}x the same run without them")
    for name in modes:
        st = {k: round(statistics.median(s.get(k, 0.0) for s in stages[name]), 3) for k in stages[name][0]}
        print(f"  stage medians (s), {name}: {st}")
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
