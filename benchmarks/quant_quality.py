"""Quality gate of each quantization format on a real model: perplexity on the hamlet sample, its
ratio to the unquantized (fp32) model's and the mean KL(fp32 || quantized), next to the goals of
issue 7 (SmolLM2-135M: int8 <= 1.005, FP8 <= 1.01, int4 <= 1.05).

    .venv/bin/python benchmarks/quant_quality.py --model smollm2-135m --threads 2 --max-tokens 2048

Same run, same tokens for every row; window 512, stride 256 (every token after the first window
is scored with at least 256 tokens of context). Each format runs its default method (GPTQ for
int8, calibrated on --calibration, which never includes the evaluated text; round-to-nearest for
int4 and fp8) unless --formats names one as FMT:METHOD (e.g. int8:rtn,fp8:gptq). GPTQ results are
cached under $FIRSTLIGHT_HOME/cache/quant. Exit status 1 if a format misses its goal.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--formats", default="int8,fp8,int4")
    ap.add_argument("--corpus", default="hamlet-sample")
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--stride", type=int, default=256)
    ap.add_argument("--skip-lm-head", action="store_true")
    ap.add_argument("--skip-embeddings", action="store_true")
    ap.add_argument("--calibration", default="shakespeare", help="GPTQ calibration corpus (Hamlet is removed)")
    ap.add_argument("--calibration-tokens", type=int, default=2048)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from firstlight.models import hub
    from firstlight.models.loader import load_model
    from firstlight.quant.calibrated import DEFAULT_METHODS, calibration_token_ids, default_cache_dir
    from firstlight.quant.quality import corpus_ids, evaluate_formats

    path = hub.resolve(args.model)
    model, tok = load_model(path)
    ids = corpus_ids(tok, args.corpus, args.max_tokens)
    specs = [f.split(":") for f in args.formats.split(",")]
    formats = [s[0] for s in specs]
    methods = {s[0]: s[1] if len(s) > 1 else DEFAULT_METHODS.get(s[0], "rtn") for s in specs}
    if len(set(formats)) != len(formats):
        ap.error("name each format once in --formats (run again for another method)")
    cal = calibration_token_ids(tok, args.calibration, args.calibration_tokens) if "gptq" in methods.values() else []
    opts = {}
    for f in formats:
        opts[f] = {"skip_lm_head": args.skip_lm_head, "skip_embeddings": args.skip_embeddings, "method": methods[f]}
        if methods[f] == "gptq":
            opts[f].update(calibration_ids=cal, calibration_name=args.calibration, cache_dir=default_cache_dir())
    base, results = evaluate_formats(model, ids, formats, window=args.window, stride=args.stride, quant_opts=opts)
    if args.json:
        print(json.dumps({"model": str(path), "threads": args.threads, "corpus": args.corpus,
                          "results": [r.to_dict() for r in (base, *results)]}, indent=2))
    else:
        print(f"{path.name} on {args.corpus}: {base.num_tokens} tokens, window {args.window}, stride {args.stride}, "
              f"{args.threads} threads; fp32 perplexity {base.perplexity:.4f}, weights {base.weight_bytes / 2**20:.1f} MiB")
        print(f"{'format':<8}{'method':<6}{'perplexity':>12}{'ratio':>10}{'goal':>8}{'':>8}{'mean KL':>10}{'MiB':>8}  kernel")
        for r in results:
            goal = f"{r.goal:>8}" if r.goal else f"{'':>8}"
            verdict = "" if r.passed is None else ("ok" if r.passed else "MISSED")
            print(f"{r.format:<8}{r.method:<6}{r.perplexity:>12.4f}{r.ppl_ratio:>10.5f}{goal}{verdict:>8}{r.mean_kl:>10.5f}"
                  f"{r.weight_bytes / 2**20:>8.1f}  {r.kernel}" + (f"; {r.calibration}" if r.calibration else ""))
    sys.exit(1 if any(r.passed is False for r in results) else 0)


if __name__ == "__main__":
    main()
