"""`firstlight verify` of real models on every emulated chip profile: the table in docs/EMULATION.md.

    python benchmarks/emulated_verify.py --models smollm2-135m,gemma3-270m --threads 2 --out reports/emulated

For each model and chip: the verdict with the chip's defaults (a chip whose compiler lacks an op
stops at compile time, as a real bring-up would), then, where the defaults do not compile, the
verdict with the one override a bring-up engineer applies first (the missing ops on the host).
Each row: verdict, top-1 agreement, perplexity ratio, mean KL, first failing unit and op, and the
tokens/s the chip's spec predicts for that configuration. Results are also written as JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

CHIPS = ["wormhole-n300", "blackhole-p150", "trn2", "h100", "mi300x", "tpu-v5e", "mx"]


def run_one(model: str, chip: str, overrides: Path | None, threads: int) -> dict:
    from firstlight.errors import FirstlightError
    from firstlight.verify.cli import _run

    t0 = time.perf_counter()
    try:
        r = _run(model, f"emulate:{chip}", "float32", None, 16, 256, None, threads, overrides=overrides).to_dict()
    except FirstlightError as e:
        return {"model": model, "chip": chip, "overrides": str(overrides or ""), "verdict": "compile error",
                "error": str(e).split(". Override")[0], "seconds": time.perf_counter() - t0}
    p, q = r["parity"], r.get("perplexity") or {}
    c = r.get("culprit") or {}
    first = (r.get("first_failing") or {}).get("unit")
    pred = r["target_report"].get("details", {}).get("predicted", {})
    return {"model": model, "chip": chip, "overrides": str(overrides or ""), "verdict": r["verdict"],
            "top1": p["top1_agreement"], "kl": p["mean_kl"], "ppl_ratio": q.get("ratio"),
            "first_failing": first, "culprit": f"{c['op']} in {c['module']}" if c else None,
            "reasons": r["reasons"][:3], "tokens_per_s": pred.get("decode_tokens_per_s"),
            "prefill_ms": pred.get("prefill_ms"), "seconds": time.perf_counter() - t0,
            "timings_s": r["timings_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2-135m,gemma3-270m")
    ap.add_argument("--chips", default=",".join(CHIPS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("reports/emulated"))
    ap.add_argument("--table", type=Path, nargs="+", help="only print the table of these results.json files")
    args = ap.parse_args()
    if args.table:
        table([row for p in args.table for row in json.loads(p.read_text())])
        return
    import torch
    import yaml

    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    host_tables = args.out / "host-tables.yaml"
    host_tables.write_text(yaml.safe_dump({"rules": [{"module": "rotary", "fallback": "host"}]}))
    rows = []
    for model in args.models.split(","):
        for chip in args.chips.split(","):
            row = run_one(model, chip, None, args.threads)
            rows.append(row)
            print(json.dumps(row), flush=True)
            if row["verdict"] == "compile error" and "aten.cos" in row.get("error", ""):
                row = run_one(model, chip, host_tables, args.threads)
                rows.append(row)
                print(json.dumps(row), flush=True)
            (args.out / "results.json").write_text(json.dumps(rows, indent=1))
    print(f"\n{torch.get_num_threads()} torch threads\n")
    table(rows)


def table(rows: list[dict]) -> None:
    """The docs/EMULATION.md table: one row per (model, chip, overrides), with why a failing row fails."""
    print("| model | chip | overrides | verdict | top-1 | ppl ratio | mean KL | first failing unit / culprit | "
          "why (verify's first reasons) | predicted tok/s (batch 1) |")
    print("|---|---|---|---|---:|---:|---:|---|---|---:|")
    for r in rows:
        ov = "rotary tables on host" if r["overrides"] else "defaults"
        if r["verdict"] == "compile error":
            print(f"| {r['model']} | {r['chip']} | {ov} | compile error | | | | | {r['error']} | |")
            continue
        where = r["culprit"] or (f"{r['first_failing']} (no single op)" if r["first_failing"] else "-")
        why = "; ".join(x.split(": max row")[0] for x in r["reasons"][:2]) if r["verdict"] != "match" else ""
        print(f"| {r['model']} | {r['chip']} | {ov} | {r['verdict']} | {r['top1']:.3f} | {r['ppl_ratio']:.4f} | "
              f"{r['kl']:.3g} | {where} | {why} | {r['tokens_per_s']:.0f} |")


if __name__ == "__main__":
    main()
