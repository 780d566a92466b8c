"""What emulating a chip costs: `verify` of SmolLM2-135M on emulated chips vs the same verify on eager fp32.

    .venv/bin/python benchmarks/emulated_verify_speed.py --threads 2 --repeats 3 --chips wormhole-n300,h100,tpu-v5e

Goal (issue #11): an emulated verify costs at most 5x the eager fp32 verify. Every run uses the same
VerifyConfig (the CLI's defaults: 16-token continuation from a warm reference cache, 256 perplexity
tokens, the serving paths), the same preloaded HF reference and a fresh copy of our model, loaded
outside the timed region. Each repeat runs eager then every chip back to back (same load on a shared
machine); the table gives medians of wall and process CPU time and the ratios to eager, and the
bound each is next to: eager verify itself. Wormhole runs with its rotary tables on the host (its
compiler lacks cos/sin, so its defaults stop at compile time).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chips", default="wormhole-n300,h100,tpu-v5e,mx")
    ap.add_argument("--model", default="smollm2-135m")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import yaml

    from firstlight.data import load_text
    from firstlight.models.hub import resolve
    from firstlight.models.loader import load_model, load_tokenizer
    from firstlight.targets.registry import get_target
    from firstlight.verify.harness import DEFAULT_PROMPT, VerifyConfig, load_reference, run_verify
    from firstlight.verify.refcache import ContinuationCache

    path = resolve(args.model)
    ref = load_reference(path)
    tok = load_tokenizer(path)
    prompt = tok(DEFAULT_PROMPT)["input_ids"]
    ppl_ids = tok(load_text("hamlet-sample"), verbose=False)["input_ids"]
    cache = ContinuationCache(Path(tempfile.mkdtemp(prefix="verify-cache-")))
    host = Path(tempfile.mkdtemp()) / "host-tables.yaml"
    host.write_text(yaml.safe_dump({"rules": [{"module": "rotary", "fallback": "host"}]}))

    def spec_of(chip: str) -> str:
        if chip == "eager":
            return "eager"
        return f"emulate:{chip}" + (f",overrides={host}" if chip in ("wormhole-n300", "blackhole-p150") else "")

    def verify(chip: str) -> tuple[float, float, str, dict]:
        model, _ = load_model(path, with_tokenizer=False)
        target = get_target(spec_of(chip))
        t0, c0 = time.perf_counter(), time.process_time()
        res = run_verify(path, target, spec_of(chip), prompt, VerifyConfig(), ppl_ids=ppl_ids, reference=ref,
                         model=model, reference_cache=cache)
        phases = res.to_dict().get("timings_s") or {}
        return time.perf_counter() - t0, time.process_time() - c0, res.verdict, phases

    names = ["eager", *args.chips.split(",")]
    verify("eager")  # warms the reference cache
    wall: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    verdicts: dict[str, str] = {}
    for r in range(args.repeats):
        for n in names:
            w, c, v, phases = verify(n)
            wall[n].append(w)
            cpu[n].append(c)
            verdicts[n] = v
            split = ", ".join(f"{k} {t:.1f}" for k, t in phases.items())
            print(f"repeat {r}: {n:<15} wall {w:7.1f} s  cpu {c:7.1f} s  {v}  ({split})", flush=True)
    load = os.getloadavg()[0]
    print(f"\n{args.model}, {torch.get_num_threads()} threads, {args.repeats} repeats, load average {load:.1f}\n")
    print("| target | verdict | wall s (median) | x eager | CPU s (median) | x eager | goal |")
    print("|---|---|---:|---:|---:|---:|---|")
    ew, ec = statistics.median(wall["eager"]), statistics.median(cpu["eager"])
    for n in names:
        w, c = statistics.median(wall[n]), statistics.median(cpu[n])
        print(f"| {spec_of(n).split(',')[0]} | {verdicts[n]} | {w:.1f} | {w / ew:.2f} | {c:.1f} | {c / ec:.2f} | "
              f"{'bound' if n == 'eager' else '<= 5x'} |")


if __name__ == "__main__":
    main()
