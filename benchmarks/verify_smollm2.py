"""Wall time of `verify` on SmolLM2-135M with a planted fault in layer 20 of 30, next to its bound:
two plain forward passes (reference + target) of the same token sequence. Goal: under 3x.

    .venv/bin/python benchmarks/verify_smollm2.py [--threads 2] [--repeats 3]

Models are loaded once, outside the timed region. Prints medians over --repeats.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
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
    fault = Fault("scale", op="aten.silu", layer=20, value=1.2)

    def timed(fn) -> list[float]:
        out = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return out

    for new_tokens in (0, 16):
        res = run_verify(path, FaultyTarget(faults=[fault]), "faulty", prompt, VerifyConfig(new_tokens=new_tokens, ppl_tokens=0), reference=ref)
        assert res.culprit and res.culprit["module"] == "layers.20.mlp", res.culprit
        seq = torch.tensor([res.tokens])

        def two_forwards(seq: torch.Tensor = seq) -> None:
            with torch.no_grad():
                ref(seq)
                ours(seq)

        def verify(new_tokens: int = new_tokens) -> None:
            run_verify(path, FaultyTarget(faults=[fault]), "faulty", prompt,
                       VerifyConfig(new_tokens=new_tokens, ppl_tokens=0), reference=ref)

        base = statistics.median(timed(two_forwards))
        ver = statistics.median(timed(verify))
        print(f"seq {seq.shape[1]} tokens (greedy continuation {new_tokens}), threads {args.threads}: "
              f"verify {ver:.2f} s vs two forward passes {base:.2f} s = {ver / base:.2f}x (goal < 3x); "
              f"culprit {res.culprit['op']} in {res.culprit['module']} at {res.culprit['source']}")
        print("  stages (last run):", {k: round(v, 2) for k, v in res.timings_s.items()})


if __name__ == "__main__":
    main()
