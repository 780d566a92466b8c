"""Metrics from per-request records. Every formula is in `FORMULAS`, written next to the numbers.

Times in records are seconds; every latency reported here is milliseconds (`*_ms`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from firstlight.bench.client import RequestRecord
from firstlight.core.slo import parse_slo_ms

PERCENTILE_METHOD = "linear"  # numpy's default: Hyndman & Fan type 7, linear between order statistics
STAT_NAMES = ("mean", "median", "p90", "p95", "p99", "std", "min", "max")

FORMULAS: dict[str, str] = {
    "ttft_ms": "first non-empty content chunk arrival - request send time (role-only/empty chunks ignored)",
    "itl_chunk_ms": "arrival(chunk k) - arrival(chunk k-1) over consecutive non-empty content chunks, k >= 1",
    "itl_token_ms": "for each chunk k >= 1: (arrival(k) - arrival(k-1)) / tokens(k), counted tokens(k) times "
                    "(token-weighted; equals itl_chunk_ms when every chunk holds one token)",
    "tpot_ms": "(e2e - ttft) / (output_tokens - 1), per request with output_tokens >= 2",
    "e2e_ms": "end of stream ([DONE] or last byte) - request send time",
    "duration_s": "last measured request end - first measured request send (warm-up excluded)",
    "request_throughput": "successful measured requests / duration_s",
    "input_throughput": "sum(input_tokens of successful requests) / duration_s; null when any request's count is "
                        "unknown (no --tokenizer and no usage from the server)",
    "output_throughput": "sum(output_tokens of successful requests) / duration_s",
    "goodput": "successful requests meeting every SLO given (ttft_ms, tpot_ms, e2e_ms <= limit) / duration_s; "
               "a request with 1 output token has no TPOT and meets any TPOT limit",
    "tokens_per_s_per_user": "1000 / median tpot_ms (decode speed one user sees)",
    "request_rate_achieved": "(measured requests - 1) / (last send - first send)",
    "request_rate_scheduled": "(measured requests - 1) / (last scheduled send - first scheduled send): what the "
                              "arrival process asked for (a Poisson sample's own rate, not the nominal one)",
    "dispatch_lag_ms": "send time - scheduled time; large values mean the client (or connection setup) fell behind",
    "percentiles": "numpy.percentile(method='linear'), i.e. Hyndman-Fan type 7",
}


@dataclass(frozen=True)
class SLO:
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    @staticmethod
    def parse(text: str | None) -> SLO | None:
        """`ttft=200,tpot=50ms,e2e=2s`: milliseconds unless suffixed with s or ms (firstlight/core/slo.py)."""
        if not text:
            return None
        return SLO(**{f"{k}_ms": v for k, v in parse_slo_ms(text).items()})

    def met(self, ttft_ms: float, tpot_ms: float | None, e2e_ms: float) -> bool:
        return ((self.ttft_ms is None or ttft_ms <= self.ttft_ms)
                and (self.tpot_ms is None or tpot_ms is None or tpot_ms <= self.tpot_ms)
                and (self.e2e_ms is None or e2e_ms <= self.e2e_ms))

    def __str__(self) -> str:
        return ",".join(f"{k[:-3]}={v:g}ms" for k, v in vars(self).items() if v is not None)


def assign_chunk_tokens(rec: RequestRecord, tok: Any = None) -> str:
    """Fill rec.chunk_tokens and rec.output_tokens; return how the tokens were counted."""
    n = len(rec.chunk_times)
    if tok is not None and rec.text:
        enc = tok.encode(rec.text, add_special_tokens=False)
        ends, acc = [], 0
        for c in rec.chunk_chars:
            acc += c
            ends.append(acc)
        counts = [0] * n
        k = 0
        for start, _ in enc.offsets:
            while k < n - 1 and start >= ends[k]:
                k += 1
            counts[k] += 1
        rec.chunk_tokens, rec.output_tokens = counts, len(enc.ids)
        return "tokenizer"
    if len(rec.chunk_usage) == n and n and rec.chunk_usage[-1] > 0:
        prev, counts = 0, []
        for c in rec.chunk_usage:
            counts.append(max(c - prev, 0))
            prev = c
        rec.chunk_tokens = counts
        rec.output_tokens = rec.usage_completion_tokens or sum(counts)
        return "server_usage_per_chunk"
    total = rec.usage_completion_tokens
    if total and n and total != n:
        rec.chunk_tokens = _split_by_chars(total, rec.chunk_chars)
        rec.output_tokens = total
        return "server_usage_split_by_chars"
    rec.chunk_tokens = [1] * n
    rec.output_tokens = total or n
    return "server_usage" if total else "one_per_chunk"


def _split_by_chars(total: int, chars: list[int]) -> list[int]:
    """Distribute `total` tokens over chunks in proportion to characters (largest remainder)."""
    n = len(chars)
    base = [1] * n if total >= n else [0] * n
    rest = total - sum(base)
    csum = sum(chars) or n
    shares = [rest * (c or 1) / csum for c in chars]
    out = [b + int(s) for b, s in zip(base, shares, strict=True)]
    left = total - sum(out)
    for i in sorted(range(n), key=lambda i: -(shares[i] - int(shares[i])))[:left]:
        out[i] += 1
    return out


def per_request(rec: RequestRecord) -> dict[str, Any]:
    """Derived latencies of one successful request (ms)."""
    ttft = (rec.chunk_times[0] - rec.t_send) * 1e3
    e2e = (rec.t_end - rec.t_send) * 1e3
    out = rec.output_tokens or len(rec.chunk_times)
    tpot = (e2e - ttft) / (out - 1) if out > 1 else None
    gaps = np.diff(np.asarray(rec.chunk_times)) * 1e3
    toks = np.asarray(rec.chunk_tokens[1:] if rec.chunk_tokens else [1] * len(gaps), dtype=float)
    keep = toks > 0
    itl_token = np.repeat(gaps[keep] / toks[keep], toks[keep].astype(int))
    return {"ttft_ms": ttft, "e2e_ms": e2e, "tpot_ms": tpot, "itl_chunk_ms": gaps, "itl_token_ms": itl_token,
            "output_tokens": out, "input_tokens": rec.input_tokens if rec.input_tokens is not None
            else rec.usage_prompt_tokens}


def stats(values: Any) -> dict[str, float | int | None]:
    a = np.asarray(values, dtype=float)
    if a.size == 0:
        return {"count": 0, **{k: None for k in STAT_NAMES}}
    p = np.percentile(a, [50, 90, 95, 99], method=PERCENTILE_METHOD)
    return {"count": int(a.size), "mean": float(a.mean()), "median": float(p[0]), "p90": float(p[1]),
            "p95": float(p[2]), "p99": float(p[3]), "std": float(a.std()), "min": float(a.min()), "max": float(a.max())}


def summarize(records: list[RequestRecord], slo: SLO | None = None, tok: Any = None) -> dict[str, Any]:
    """The run summary: latency stats, throughputs, goodput and error counts (warm-up excluded)."""
    measured = [r for r in records if not r.warmup and r.error != "incomplete"]
    ok = [r for r in measured if r.ok]
    sources = Counter(assign_chunk_tokens(r, tok) for r in ok)
    per = [per_request(r) for r in ok]
    errors = Counter(r.error for r in measured if not r.ok)
    out: dict[str, Any] = {"num_requests": len(measured), "num_ok": len(ok), "num_errors": sum(errors.values()),
                           "errors_by_kind": dict(sorted(errors.items())),
                           "num_warmup": sum(r.warmup for r in records),
                           "num_incomplete": sum(r.error == "incomplete" for r in records),
                           "token_count_source": dict(sources)}
    if measured:
        t0 = min(r.t_send for r in measured)
        t1 = max(r.t_end for r in measured)
        dur = max(t1 - t0, 1e-9)
        sends = sorted(r.t_send for r in measured)
        out["request_rate_achieved"] = (len(sends) - 1) / (sends[-1] - sends[0]) if len(sends) > 1 and sends[-1] > sends[0] else None
        sched = sorted(r.t_scheduled for r in measured)
        out["request_rate_scheduled"] = (len(sched) - 1) / (sched[-1] - sched[0]) if len(sched) > 1 and sched[-1] > sched[0] else None
        out["dispatch_lag_ms"] = stats([(r.t_send - r.t_scheduled) * 1e3 for r in measured if r.t_send])
    else:
        dur = 0.0
    out["duration_s"] = dur
    if not per:
        return out
    # an input count is unknown without --tokenizer when the server sends no usage: never count it as 0
    in_known = [p["input_tokens"] for p in per if p["input_tokens"] is not None]
    in_complete = len(in_known) == len(per)
    out_tok = [p["output_tokens"] for p in per]
    out["num_input_tokens_unknown"] = len(per) - len(in_known)
    out["total_input_tokens"] = int(sum(in_known)) if in_complete else None
    out["total_output_tokens"] = int(sum(out_tok))
    out["request_throughput"] = len(ok) / dur
    out["input_throughput"] = sum(in_known) / dur if in_complete else None
    out["output_throughput"] = sum(out_tok) / dur
    for name in ("ttft_ms", "tpot_ms", "e2e_ms"):
        out[name] = stats([p[name] for p in per if p[name] is not None])
    out["itl_chunk_ms"] = stats(np.concatenate([p["itl_chunk_ms"] for p in per]))
    out["itl_token_ms"] = stats(np.concatenate([p["itl_token_ms"] for p in per]))
    out["input_tokens"] = stats(in_known)
    out["output_tokens"] = stats(out_tok)
    med_tpot = out["tpot_ms"]["median"]
    out["tokens_per_s_per_user"] = 1000.0 / med_tpot if med_tpot else None
    if slo is not None:
        good = sum(slo.met(p["ttft_ms"], p["tpot_ms"], p["e2e_ms"]) for p in per)
        out["slo"] = str(slo)
        out["num_good"] = int(good)
        out["goodput"] = good / dur
        out["slo_attainment"] = good / len(measured)
    return out
