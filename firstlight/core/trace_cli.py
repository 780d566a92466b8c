"""`firstlight trace ...`: look at an engine trace and export it for Perfetto / chrome://tracing."""

from __future__ import annotations

import json
from pathlib import Path

import typer

app = typer.Typer(help="Engine traces (`firstlight serve --trace FILE`): summary and Chrome/Perfetto export.",
                  no_args_is_help=True)
FILE = typer.Argument(..., help="engine trace JSONL (.jsonl or .jsonl.gz) written by the engine's --trace")


def _load(path: Path):  # -> Trace
    from firstlight.core.trace import Trace, TraceFormatError
    from firstlight.errors import FirstlightError

    try:
        return Trace.load(path)
    except FileNotFoundError:
        raise FirstlightError(f"trace FILE {path} does not exist") from None
    except TraceFormatError as e:
        raise FirstlightError(f"trace FILE {path}: {e}") from None


@app.command()
def export(trace: Path = FILE,
           out: Path = typer.Option(Path("trace.json"), "--out", help="Chrome trace-event JSON to write")) -> None:
    """Chrome / Perfetto JSON: the engine's steps on one track, one track per request (queued, prefill,
    decode, recompute slices and a first-token marker). Open it at ui.perfetto.dev."""
    tr = _load(trace)
    chrome = tr.to_chrome()
    out.write_text(json.dumps(chrome))
    num_tracks = len({e["tid"] for e in chrome["traceEvents"] if e.get("pid") == 1 and e["ph"] == "X"})
    typer.echo(f"{out}: {len(chrome['traceEvents'])} events, {len(tr.steps)} steps, {num_tracks} request tracks")


@app.command()
def show(trace: Path = FILE) -> None:
    """Steps, requests, engine settings, and TTFT / TPOT / e2e percentiles as the engine measured them."""
    import numpy as np

    from firstlight.core.trace import infer_requests

    tr = _load(trace)
    reqs = tr.requests or infer_requests(tr)
    done = [r for r in reqs if r.first_token_s is not None and r.finish_s is not None]

    def pct(xs: list[float]) -> dict[str, float]:
        return {f"p{q}_ms": float(np.percentile(xs, q)) * 1e3 for q in (50, 90, 99)} if xs else {}

    multi = [r for r in done if r.num_output_tokens > 1]
    typer.echo(json.dumps({
        "meta": tr.meta, "num_steps": len(tr.steps), "num_requests": len(reqs),
        "requests_inferred_from_steps": not tr.requests,
        "step_ms": pct([s.total_s for s in tr.steps]),
        "has_cpu_times": bool(tr.steps) and all(s.cpu_s for s in tr.steps),
        "ttft": pct([r.first_token_s - r.arrival_s for r in done]),
        "tpot": pct([(r.finish_s - r.first_token_s) / (r.num_output_tokens - 1) for r in multi]),
        "e2e": pct([r.finish_s - r.arrival_s for r in done]),
    }, indent=2, default=str))
