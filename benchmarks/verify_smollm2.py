"""Wall time of `verify` on SmolLM2-135M with a planted fault in layer 20 of 30, next to its bound:
two plain forward passes (reference + target) of the same token sequence. Goal: under 3x.

    .venv/bin/python benchmarks/verify_smollm2.py [--threads 1] [--repeats 3]

The HF reference and a fresh copy of our model (the target consumes it: `prepare` hooks it) are
loaded before each timed run, outside the timed region, as the baseline's two models are. Each
repeat times the baseline and verify back to back (same load on a shared machine); prints the
medians, their ratio, and the median time of each verify stage.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", default="0,16", help="greedy continuations to measure, comma separated")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from firstlight.models.hub import resolve
    from firstlight.models.loader import load_model, load_tokenizer
    from firstlight.targets.faulty import Fault, FaultyTarget
    from firstlight.verify.harness import DEFAULT_PROMPT, VerifyConfig, load_reference, run_verify

    path = resolve("smollm2-135m")
    ref = load_reference(path)
    ours, _ = load_model(path, with_tokenizer=False)
    prompt = load_tokenizer(path)(DEFAULT_PROMPT)["input_ids"]

    def verify(new_tokens: int):  # -> VerifyResult
        fault = Fault("scale", op="aten.silu", layer=20, value=1.2)
        model, _ = load_model(path, with_tokenizer=False)  # untimed: the target consumes its model
        t0 = time.perf_counter()
        res = run_verify(path, FaultyTarget(faults=[fault]), "faulty", prompt,
                         VerifyConfig(new_tokens=new_tokens, ppl_tokens=0), reference=ref, model=model)
        return time.perf_counter() - t0, res

    load = os.getloadavg()[0]
    print(f"machine: {os.cpu_count()} cores, load average {load:.1f}; torch threads {args.threads}; "
          f"medians of {args.repeats} repeats")
    for new_tokens in (int(n) for n in args.new_tokens.split(",")):
        _, res = verify(new_tokens)  # warm-up; checks the fault is found
        assert res.culprit and res.culprit["module"] == "layers.20.mlp", res.culprit
        seq = torch.tensor([res.tokens])
        bases, gens, vers, stages = [], [], [], []
        prompt_t = torch.tensor([prompt])
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            with torch.no_grad():
                ref(seq)
                ours(seq)
            bases.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            if new_tokens:  # the reference's greedy continuation: sequential decode steps, inherent to the check
                ref.generate(prompt_t, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
            gens.append(time.perf_counter() - t0)
            t, res = verify(new_tokens)
            vers.append(t)
            stages.append(res.timings_s)
        base, gen, ver = statistics.median(bases), statistics.median(gens), statistics.median(vers)
        print(f"seq {seq.shape[1]} tokens (greedy continuation {new_tokens}): verify {ver:.2f} s vs two forward "
              f"passes {base:.2f} s = {ver / base:.2f}x (goal < 3x); culprit {res.culprit['op']} in "
              f"{res.culprit['module']} at {res.culprit['source']}")
        if new_tokens:
            print(f"  with the reference's {new_tokens}-token greedy generation ({gen:.2f} s) added to the bound: "
                  f"{ver:.2f} s vs {base + gen:.2f} s = {ver / (base + gen):.2f}x")
        med = {k: round(statistics.median(s.get(k, 0.0) for s in stages), 3) for k in stages[0]}
        print(f"  stage medians (s): {med}; isolated units reused: {len(res.isolated_reused)}")
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
