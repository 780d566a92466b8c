"""Prefill and decode tokens/s of our implementation vs HF transformers, same run, same threads.

    .venv/bin/python benchmarks/generate.py --model smollm2-135m --threads 2

Method (identical for both sides): prefill = one forward over the prompt; decode tokens/s =
(N - 1) / (T(generate N tokens) - T(generate 1 token)), greedy, batch 1, fp32 unless --dtype.
Each figure is the median of --repeats runs. Next to each decode figure: the weight bytes it reads
per token and the memory bandwidth that implies, against a measured memory bandwidth of this machine
(decode at batch 1 is memory-bound: tokens/s <= bandwidth / bytes of weights read per token).
"""

from __future__ import annotations

import argparse
import json

import torch
from _common import median_time, memory_bandwidth_gbs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    from firstlight.models import hub
    from firstlight.models.generate import generate_tokens
    from firstlight.models.loader import load_model, parse_dtype

    path = hub.resolve(args.model)
    dtype = parse_dtype(args.dtype)
    ours, tok = load_model(path, dtype=dtype)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").eval()
    text = "The history of the city begins in the early middle ages, when " * 64
    prompt = tok.encode(text)[: args.prompt_tokens]
    ids = torch.tensor([prompt])
    n = args.new_tokens

    @torch.inference_mode()
    def ours_gen(k: int) -> None:
        for _ in generate_tokens(ours, prompt, k):
            pass

    @torch.inference_mode()
    def hf_gen(k: int) -> None:
        ref.generate(ids, max_new_tokens=k, min_new_tokens=k, do_sample=False, pad_token_id=0)

    @torch.inference_mode()
    def ours_prefill() -> None:
        ours(ids)

    @torch.inference_mode()
    def hf_prefill() -> None:
        ref(ids)

    for fn in (ours_prefill, hf_prefill, lambda: ours_gen(4), lambda: hf_gen(4)):  # warm-up
        fn()
    res = {}
    for side, prefill, gen in (("firstlight", ours_prefill, ours_gen), ("hf", hf_prefill, hf_gen)):
        t_prefill = median_time(prefill, args.repeats)
        t_n = median_time(lambda g=gen: g(n), args.repeats)
        t_1 = median_time(lambda g=gen: g(1), args.repeats)
        res[side] = {
            "prefill_tokens_per_s": len(prompt) / t_prefill,
            "decode_tokens_per_s": (n - 1) / (t_n - t_1),
        }
    weight_bytes = sum(p.numel() * p.element_size() for p in ours.parameters())  # tied: counted once
    bw = memory_bandwidth_gbs()
    for side in res:
        res[side]["decode_weight_gb_per_s"] = res[side]["decode_tokens_per_s"] * weight_bytes / 1e9
    out = {
        "model": args.model, "dtype": args.dtype, "threads": args.threads, "prompt_tokens": len(prompt),
        "new_tokens": n, "repeats": args.repeats, "weight_bytes": weight_bytes,
        "copy_bandwidth_gb_per_s": bw, "decode_bound_tokens_per_s": bw * 1e9 / weight_bytes,
        "results": res,
        "decode_speedup_vs_hf": res["firstlight"]["decode_tokens_per_s"] / res["hf"]["decode_tokens_per_s"],
        "prefill_speedup_vs_hf": res["firstlight"]["prefill_tokens_per_s"] / res["hf"]["prefill_tokens_per_s"],
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"{args.model} {args.dtype}, {args.threads} threads, prompt {len(prompt)}, {n} new tokens, "
          f"median of {args.repeats}")
    print(f"{'':12} {'prefill tok/s':>14} {'decode tok/s':>13} {'weights GB/s':>13}")
    for side, r in res.items():
        print(f"{side:12} {r['prefill_tokens_per_s']:14.1f} {r['decode_tokens_per_s']:13.1f} "
              f"{r['decode_weight_gb_per_s']:13.2f}")
    print(f"ratio firstlight/hf: prefill {out['prefill_speedup_vs_hf']:.2f}x, decode {out['decode_speedup_vs_hf']:.2f}x")
    print(f"bound: measured memory bandwidth {bw:.1f} GB/s / {weight_bytes / 1e6:.0f} MB of weights per token "
          f"= {out['decode_bound_tokens_per_s']:.0f} tok/s (batch-1 decode is memory-bound)")


if __name__ == "__main__":
    main()
