"""`result.vllm.json`: a run in the JSON layout `vllm bench serve --save-result` writes, so tools that read
vLLM's results (dashboards, comparison scripts) read ours too.

Keys and units follow vLLM's benchmarks/serve.py: per-request lists (`ttfts` in seconds, `itls` as a
list of seconds per request, `input_lens`, `output_lens`, `errors`, `generated_texts`), totals and
throughputs, and `mean_/median_/std_/pNN_` statistics in milliseconds for ttft, tpot, itl and e2el
over the successful requests. Where vLLM's value and ours are defined differently, ours is written:
`itl` is per chunk (vLLM's definition too), `tpot` is (e2e - ttft) / (output_tokens - 1) as in vLLM.
Warm-up and incomplete requests are left out, as vLLM has none.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np

from firstlight.bench.metrics import per_request

if TYPE_CHECKING:
    from firstlight.bench.run import RunResult

PERCENTILES = (90, 95, 99)


def _stats(name: str, values_ms: list[float]) -> dict[str, float]:
    a = np.asarray(values_ms, dtype=float)
    if a.size == 0:
        a = np.zeros(1)  # vLLM reports 0 for a metric with no samples
    out = {f"mean_{name}_ms": float(a.mean()), f"median_{name}_ms": float(np.median(a)),
           f"std_{name}_ms": float(a.std())}
    for p in PERCENTILES:
        out[f"p{p}_{name}_ms"] = float(np.percentile(a, p))
    return out


def vllm_result(result: RunResult) -> dict[str, Any]:
    cfg, m = result.config, result.summary
    recs = [r for r in result.output.records if not r.warmup and r.error != "incomplete"]
    ok = [r for r in recs if r.ok and r.chunk_times]
    per = {id(r): per_request(r) for r in ok}
    load = cfg.load
    rate: float | str = load.rate if load.mode == "rate" else "inf"
    out_lens = [int(per[id(r)]["output_tokens"]) if id(r) in per else 0 for r in recs]
    in_lens = [r.input_tokens if r.input_tokens is not None else r.usage_prompt_tokens for r in recs]
    total_in = m.get("total_input_tokens")
    total_out = m.get("total_output_tokens") or 0
    dur = m.get("duration_s") or 0.0
    res: dict[str, Any] = {
        "date": time.strftime("%Y%m%d-%H%M%S"),
        "backend": "openai-chat" if cfg.endpoint == "chat" else "openai",
        "label": cfg.label or None,
        "model_id": cfg.model,
        "tokenizer_id": cfg.workload.tokenizer,
        "num_prompts": len(recs),
        "request_rate": rate,
        "burstiness": load.burstiness,
        "max_concurrency": load.concurrency if load.mode == "concurrency" else load.max_concurrency,
        "duration": dur,
        "completed": len(ok),
        "failed": len(recs) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": m.get("request_throughput") or 0.0,
        "request_goodput": m.get("goodput"),
        "output_throughput": m.get("output_throughput") or 0.0,
        "total_token_throughput": (total_in + total_out) / dur if total_in is not None and dur else None,
        "input_lens": in_lens,
        "output_lens": out_lens,
        "ttfts": [per[id(r)]["ttft_ms"] / 1e3 if id(r) in per else 0.0 for r in recs],
        "itls": [[float(x) / 1e3 for x in per[id(r)]["itl_chunk_ms"]] if id(r) in per else [] for r in recs],
        "generated_texts": [r.text for r in recs],
        "errors": [f"{r.error}: {r.error_detail}".rstrip(": ") if r.error else "" for r in recs],
        "partial": result.partial,
        "source": "firstlight bench run (result.json has the full result, with formulas)",
    }
    pr = list(per.values())
    res |= _stats("ttft", [p["ttft_ms"] for p in pr])
    res |= _stats("tpot", [p["tpot_ms"] for p in pr if p["tpot_ms"] is not None])
    res |= _stats("itl", [float(x) for p in pr for x in p["itl_chunk_ms"]])
    res |= _stats("e2el", [p["e2e_ms"] for p in pr])
    return res
