"""The sampler's cost per decode step for sampled (temperature > 0) rows: firstlight's inverse-CDF draw (one
uniform per row, engine/sampler.py) vs the exponential race it replaced (one Exp(1) per vocabulary entry per
row, argmax p / E), same rows, same run, on Zipf-like logits (p ~ rank^-1.2); and the bound: one pass over the logits (the softmax alone).

    PYTHONPATH=. .venv/bin/python benchmarks/sampler_speed.py --threads 2 --vocab 49152 --rows 1,8,32
"""

from __future__ import annotations

import argparse

import torch
from _common import median_time

from firstlight.engine.request import Request, SamplingParams
from firstlight.engine.sampler import Sampler, filter_logits


def exponential_race(sampler: Sampler, logits: torch.Tensor, requests: list[Request]) -> list[int]:
    out = []
    for i, r in enumerate(requests):
        probs = filter_logits(logits[i], r.sampling_params).softmax(-1)
        race = torch.empty_like(probs).exponential_(generator=sampler.generator(r))
        out.append(int((probs / race).argmax()))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"vocab {args.vocab}, {args.threads} thread(s), seeded rows; ms per step")
    print(f"{'params':>24} {'rows':>5} {'inverse CDF':>12} {'exp. race':>10} {'race / ours':>12} {'softmax only':>13}")
    for label, params in (("temperature 0.8", SamplingParams(max_tokens=16, temperature=0.8, seed=1)),
                          ("+ top_p 0.95 (a sort)", SamplingParams(max_tokens=16, temperature=0.8, top_p=0.95, seed=1))):
        for n in (int(r) for r in args.rows.split(",")):
            torch.manual_seed(0)  # Zipf-like rows (p ~ rank^-1.2, shuffled), as a language model's are
            ranks = torch.arange(1, args.vocab + 1, dtype=torch.float32)
            logits = torch.stack([(-1.2 * ranks.log())[torch.randperm(args.vocab)] for _ in range(n)])
            logits += 0.3 * torch.randn(n, args.vocab)
            requests = [Request(f"r{i}", [1, 2, 3], params) for i in range(n)]
            sampler = Sampler()
            ours = median_time(lambda: sampler.sample(logits, requests), args.repeats)  # noqa: B023
            race = median_time(lambda: exponential_race(sampler, logits, requests), args.repeats)  # noqa: B023
            bound = median_time(lambda: logits.softmax(-1), args.repeats)  # noqa: B023
            print(f"{label:>24} {n:>5} {ours * 1e3:>12.2f} {race * 1e3:>10.2f} {race / ours:>11.1f}x {bound * 1e3:>13.2f}")


if __name__ == "__main__":
    main()
