"""Greedy token agreement of quantized formats with fp32, through the engine, on the 16 prompts of the
engine's real-model test (tests/engine/test_smollm.py): staggered arrival, 24 tokens each.

    PYTHONPATH=. .venv/bin/python benchmarks/quant_agreement.py --formats int8,int4,w8a8 --threads 2

Per format: the share of the 16 x 24 token positions equal to fp32's, the mean length of the common
prefix (greedy decoding diverges for good after its first different token, so this is the stricter
figure), how many prompts match fp32 entirely, and the texts of the prompts that differ.
"""

from __future__ import annotations

import argparse
import os

import torch


def run_engine(model, tok, prompts: list[str], n: int) -> list[list[int]]:
    from firstlight.engine.engine import EngineConfig, LLMEngine
    from firstlight.engine.request import SamplingParams

    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    engine = LLMEngine(model, tok, EngineConfig(block_size=16, num_blocks=512, max_num_batched_tokens=64))
    ids = [tok.encode(p) for p in prompts]
    done, rid_to_i, pending, step = {}, {}, list(enumerate(ids)), 0
    while pending or engine.has_unfinished():
        if pending and step % 3 == 0:
            i, p = pending.pop(0)
            rid_to_i[engine.add_request(p, params).request_id] = i
        for out in engine.step():
            if out.finished:
                done[rid_to_i[out.request_id]] = out.output_token_ids
        step += 1
    return [done[i] for i in range(len(prompts))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--formats", default="int8,int4,w8a8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from firstlight.models import hub
    from firstlight.models.loader import load_model
    from firstlight.quant import apply_quantization
    from tests.engine.test_smollm import PROMPTS

    path = hub.resolve(args.model)
    model, tok = load_model(path)
    ref = run_engine(model, tok, PROMPTS, args.max_tokens)
    print(f"{args.model}, {len(PROMPTS)} prompts x {args.max_tokens} greedy tokens through the engine, "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'format':<8} {'method':<6} {'tokens equal':>13} {'mean common prefix':>19} {'prompts identical':>18}")
    for fmt in args.formats.split(","):
        model, tok = load_model(path)
        report = apply_quantization(model, fmt, tokenizer=tok)
        out = run_engine(model, tok, PROMPTS, args.max_tokens)
        equal = sum(a == b for r, o in zip(ref, out, strict=True) for a, b in zip(r, o, strict=True))
        prefixes = []
        for r, o in zip(ref, out, strict=True):
            k = next((i for i, (a, b) in enumerate(zip(r, o, strict=True)) if a != b), len(r))
            prefixes.append(k)
        total = len(PROMPTS) * args.max_tokens
        print(f"{fmt:<8} {report.method:<6} {equal / total:13.1%} {sum(prefixes) / len(prefixes):19.1f} "
              f"{sum(k == args.max_tokens for k in prefixes):>15d}/{len(PROMPTS)}")
        for i, k in enumerate(prefixes):
            if k < args.max_tokens:
                print(f"    {PROMPTS[i]!r}: fp32 {tok.decode(ref[i])!r}\n    {'':{len(repr(PROMPTS[i]))}}  {fmt} "
                      f"{tok.decode(out[i])!r}")


if __name__ == "__main__":
    main()
