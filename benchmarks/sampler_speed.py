"""The sampler's cost per decode step for sampled (temperature > 0) rows: firstlight's inverse-CDF draw (one
uniform per row, engine/sampler.py) on our kernel (`firstlight::sample_rows`, kernels/csrc/sampling.cpp: two
read-only passes per row) and in torch (its fallback without the extension), vs the exponential race it replaced
(one Exp(1) per vocabulary entry per row, argmax p / E), same rows, same run, on Zipf-like logits
(p ~ rank^-1.2); and the bound: one pass over the logits (the softmax alone).

    PYTHONPATH=. .venv/bin/python benchmarks/sampler_speed.py --threads 2 --vocab 49152 --rows 1,8,32
"""

from __future__ import annotations

import argparse
import os

import torch
from _common import median_time

from firstlight import kernels
from firstlight.engine.request import Request, SamplingParams
from firstlight.engine.sampler import Sampler, filter_logits, filter_rows


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
    mode = os.environ.get(kernels.ENV, "auto")
    if kernels.load_kernel() is None:
        raise SystemExit("firstlight's kernel extension is not in use here (FIRSTLIGHT_CPU_KERNELS / build)")
    print(f"vocab {args.vocab}, {args.threads} thread(s), seeded rows; ms per step")
    print(f"{'params':>24} {'rows':>5} {'kernel':>7} {'torch inv. CDF':>15} {'exp. race':>10} {'torch / kernel':>15} "
          f"{'softmax only':>13}")
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
            os.environ[kernels.ENV] = "aten"  # the sampler's torch path
            torch_path = median_time(lambda: sampler.sample(logits, requests), args.repeats)  # noqa: B023
            os.environ[kernels.ENV] = mode
            race = median_time(lambda: exponential_race(sampler, logits, requests), args.repeats)  # noqa: B023
            bound = median_time(lambda: logits.softmax(-1), args.repeats)  # noqa: B023
            print(f"{label:>24} {n:>5} {ours * 1e3:>7.2f} {torch_path * 1e3:>15.2f} {race * 1e3:>10.2f} "
                  f"{torch_path / ours:>14.1f}x {bound * 1e3:>13.2f}")

    # the filters: all rows of a step at once (filter_rows) vs row by row (filter_logits, its one-row case)
    n = max(int(r) for r in args.rows.split(","))
    params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.95)
    print(f"\ntop-p 0.95 filter over {n} rows, ms: {'rows':>16} {'row by row':>11} {'batched':>8}")
    for label, scale in (("peaked (randn x 8)", 8.0), ("flat (randn x 0.01)", 0.01)):
        x = torch.randn(n, args.vocab, generator=torch.Generator().manual_seed(1)) * scale
        loop = median_time(lambda: [filter_logits(x[i], params) for i in range(n)], args.repeats)  # noqa: B023
        batched = median_time(lambda: filter_rows(x, [params] * n), args.repeats)  # noqa: B023
        print(f"{'':>34} {label:>16} {loop * 1e3:>11.2f} {batched * 1e3:>8.2f}")


if __name__ == "__main__":
    main()
