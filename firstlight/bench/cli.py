"""`firstlight bench ...`: run, sweep, compare, calibrate, reference-server."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

app = typer.Typer(help="Benchmark an OpenAI-compatible server: load tests, sweeps, Pareto, cost.", no_args_is_help=True)

# options shared by `run` and `sweep`
O_ENDPOINT = typer.Option("completions", help="completions (/v1/completions) or chat (/v1/chat/completions).")
O_MODEL = typer.Option(None, help="Model name sent to the server; default: the first one /v1/models lists.")
O_WORKLOAD = typer.Option("synthetic", help="synthetic | jsonl | shared-prefix | multi-turn.")
O_INPUT = typer.Option("fixed:128", help="Input tokens: N, fixed:N, uniform:LO:HI, normal:MEAN:STD, lognormal:MEDIAN:SIGMA.")
O_OUTPUT = typer.Option("fixed:128", help="Output tokens (max_tokens, with ignore_eos), same forms as --input-len.")
O_PROMPTS = typer.Option(None, help="JSONL file of {'prompt': ...} or {'messages': [...]} rows (--workload jsonl).")
O_GROUPS = typer.Option(4, help="shared-prefix: number of groups.")
O_PREFIX = typer.Option(256, help="shared-prefix: prefix length in tokens.")
O_TURNS = typer.Option(3, help="multi-turn: turns per conversation.")
O_TOKENIZER = typer.Option(None, help="Checkpoint dir or tokenizer.json: count tokens locally (else server usage).")
O_SEED = typer.Option(0, help="Seed of prompts and arrivals (recorded).")
O_BUST = typer.Option(False, "--cache-bust", help="Prefix every prompt with a per-run nonce (defeats prefix caches).")
O_ARRIVAL = typer.Option("poisson", help="Arrivals for --rate: poisson | gamma | constant.")
O_BURST = typer.Option(1.0, help="gamma arrivals: shape (<1 burstier, 1 = Poisson).")
O_MAXC = typer.Option(None, help="Cap on in-flight requests in rate/trace mode.")
O_RAMP = typer.Option(0.0, "--ramp-up", help="Seconds to ramp the rate (or start workers) linearly from zero.")
O_NUM = typer.Option(100, help="Measured requests (warm-up comes on top).")
O_WARM = typer.Option(0, help="Warm-up requests, excluded from results. A closed loop (--concurrency) runs them "
                      "first, at the same concurrency, and starts the measured requests when the last one ends.")
O_WARMS = typer.Option(0.0, "--warmup-s", help="Requests scheduled in the first S seconds are warm-up.")
O_DUR = typer.Option(None, "--duration", help="Stop issuing requests after this many seconds.")
O_RESET = typer.Option(False, "--reset-prefix-cache", help="POST /reset_prefix_cache before the run.")
O_SLO = typer.Option(None, help="e.g. ttft=200,tpot=50,e2e=5s (milliseconds unless suffixed with ms or s, as in "
                     "`firstlight sim`): enables goodput.")
O_BACKEND = typer.Option("raw", help="Client: raw (asyncio, default, fastest) or httpx.")
O_EOS = typer.Option(True, "--ignore-eos/--no-ignore-eos", help="Send ignore_eos so outputs have the asked length.")
O_CUSAGE = typer.Option(True, "--continuous-usage/--no-continuous-usage",
                        help="Ask for usage in every chunk (stream_options.continuous_usage_stats).")
O_TIMEOUT = typer.Option(600.0, "--timeout", help="Per-request timeout in seconds.")
O_EXTRA = typer.Option(None, help="JSON merged into every request body, e.g. '{\"temperature\": 0}'.")
O_APIKEY = typer.Option(None, envvar="FIRSTLIGHT_API_KEY", show_envvar=True,
                        help="Bearer token for the server (firstlight serve --api-key, vLLM --api-key).")


def _workload(kind: str, input_len: str, output_len: str, prompts: Path | None, num_groups: int, prefix_len: int,
              num_turns: int, tokenizer: str | None, seed: int, cache_bust: bool) -> Any:
    from firstlight.bench.workload import WorkloadSpec

    return WorkloadSpec(kind=kind, input_len=input_len, output_len=output_len, path=str(prompts) if prompts else None,
                        num_groups=num_groups, prefix_len=prefix_len, num_turns=num_turns, seed=seed,
                        cache_bust=cache_bust, tokenizer=tokenizer)


def _extra(extra_body: str | None) -> dict | None:
    from firstlight.errors import FirstlightError

    if not extra_body:
        return None
    try:
        d = json.loads(extra_body)
    except json.JSONDecodeError as e:
        raise FirstlightError(f"--extra-body is not JSON ({e.msg}); pass an object like '{{\"temperature\": 0}}'.") from None
    if not isinstance(d, dict):
        raise FirstlightError("--extra-body must be a JSON object.")
    return d


@app.command()
def run(
    url: str = typer.Option(..., help="Server base URL, e.g. http://127.0.0.1:8000"),
    out: Path = typer.Option(Path("bench-out"), help="Output dir: result.json, requests.jsonl, plots, index.html."),
    label: str = typer.Option("", help="Label of this server/config in reports."),
    endpoint: str = O_ENDPOINT, model: str | None = O_MODEL,
    workload: str = O_WORKLOAD, input_len: str = O_INPUT, output_len: str = O_OUTPUT, prompts: Path | None = O_PROMPTS,
    num_groups: int = O_GROUPS, prefix_len: int = O_PREFIX, num_turns: int = O_TURNS, tokenizer: str | None = O_TOKENIZER,
    seed: int = O_SEED, cache_bust: bool = O_BUST,
    concurrency: int = typer.Option(1, help="Closed loop: sessions in flight (used unless --rate/--trace)."),
    rate: float | None = typer.Option(None, help="Open loop: requests (sessions) per second."),
    arrival: str = O_ARRIVAL, burstiness: float = O_BURST,
    trace: Path | None = typer.Option(None, help="Replay a JSONL trace: timestamp (s) or timestamp_ms, input_len, output_len."),
    trace_time_scale: float = typer.Option(1.0, help="Multiply trace times by this (>1 slower)."),
    max_concurrency: int | None = O_MAXC, ramp_up_s: float = O_RAMP, num_requests: int = O_NUM,
    warmup_requests: int = O_WARM, warmup_s: float = O_WARMS, duration_s: float | None = O_DUR,
    reset_prefix_cache: bool = O_RESET, slo: str | None = O_SLO, backend: str = O_BACKEND,
    ignore_eos: bool = O_EOS, continuous_usage: bool = O_CUSAGE, timeout_s: float = O_TIMEOUT,
    extra_body: str | None = O_EXTRA, api_key: str | None = O_APIKEY,
    plots: bool = typer.Option(True, "--plots/--no-plots", help="Write PNG plots."),
) -> None:
    """One load run against one server; prints the metrics (with formulas in result.json).

    Exit 1 when every measured request failed; on SIGINT/SIGTERM the finished requests are written and
    result.json is marked partial (exit 130 / 143)."""
    from rich.console import Console

    from firstlight.bench.load import LoadSpec
    from firstlight.bench.metrics import SLO
    from firstlight.bench.report import _summary_text
    from firstlight.bench.run import RunConfig, run_benchmark, write_run

    SLO.parse(slo)  # fail before anything is sent
    mode = "trace" if trace else ("rate" if rate else "concurrency")
    load = LoadSpec(mode=mode, concurrency=concurrency, rate=rate or 1.0, arrival=arrival, burstiness=burstiness,
                    trace=str(trace) if trace else None, trace_time_scale=trace_time_scale,
                    max_concurrency=max_concurrency, ramp_up_s=ramp_up_s, num_requests=num_requests,
                    warmup_requests=warmup_requests, warmup_s=warmup_s, duration_s=duration_s, seed=seed)
    cfg = RunConfig(url=url, workload=_workload(workload, input_len, output_len, prompts, num_groups, prefix_len,
                                                num_turns, tokenizer, seed, cache_bust),
                    load=load, endpoint=endpoint, model=model, label=label, slo=slo, backend=backend,
                    reset_prefix_cache=reset_prefix_cache, ignore_eos=ignore_eos, continuous_usage=continuous_usage,
                    extra_body=_extra(extra_body), request_timeout_s=timeout_s, api_key=api_key)
    from firstlight.core.progress import progress
    from firstlight.errors import FirstlightError

    total = (warmup_requests + num_requests) if num_requests > 0 else None
    with progress("bench run", total=total, unit="requests") as advance:
        res = run_benchmark(cfg, progress=advance)
    write_run(out, res, plots=plots)
    con = Console()
    err = Console(stderr=True)
    con.print(_summary_text(res.result_json()), highlight=False)
    con.print(f"wrote {out}/result.json, result.vllm.json, requests.jsonl, index.html", highlight=False)
    for note in res.notes:
        err.print(f"[yellow]note:[/] {note}", highlight=False)
    if res.partial:
        err.print(f"[yellow]interrupted by {res.output.interrupted_by}:[/] wrote the {res.summary.get('num_ok', 0)} "
                  f"finished requests; {out}/result.json is marked partial", highlight=False)
        raise typer.Exit(130 if res.output.interrupted_by == "SIGINT" else 143)
    if res.all_failed:
        m = res.summary
        raise FirstlightError(f"all {m['num_requests']} measured requests failed ({m['errors_by_kind']}); results "
                              f"are in {out}, see requests.jsonl for each error.")


@app.command()
def sweep(
    url: list[str] = typer.Option(..., help="Server base URL; repeat for several servers/configs."),
    label: list[str] = typer.Option(None, help="Label per --url (same order)."),
    usd_per_hour: list[float] = typer.Option(None, help="$/hour per --url (one for all, or one each): $/1M tokens."),
    concurrency: str | None = typer.Option(None, help="Comma-separated concurrencies, e.g. 1,2,4,8,16."),
    rate: str | None = typer.Option(None, help="Comma-separated request rates (req/s) instead of concurrencies."),
    out: Path = typer.Option(Path("bench-sweep"), help="Output dir (resumes when it holds the same sweep)."),
    resume: bool = typer.Option(True, "--resume/--no-resume", help="Reuse finished points found in --out."),
    search: bool = typer.Option(True, "--search/--no-search", help="With --slo: bisect for the highest load meeting it."),
    slo_attainment: float = typer.Option(0.9, help="A load meets the SLO when this fraction of requests does."),
    max_search_points: int = typer.Option(6, help="Extra points the SLO search may run per server."),
    endpoint: str = O_ENDPOINT, model: str | None = O_MODEL,
    workload: str = O_WORKLOAD, input_len: str = O_INPUT, output_len: str = O_OUTPUT, prompts: Path | None = O_PROMPTS,
    num_groups: int = O_GROUPS, prefix_len: int = O_PREFIX, num_turns: int = O_TURNS, tokenizer: str | None = O_TOKENIZER,
    seed: int = O_SEED, cache_bust: bool = O_BUST, arrival: str = O_ARRIVAL, burstiness: float = O_BURST,
    max_concurrency: int | None = O_MAXC, ramp_up_s: float = O_RAMP, num_requests: int = O_NUM,
    warmup_requests: int = O_WARM, warmup_s: float = O_WARMS, duration_s: float | None = O_DUR,
    reset_prefix_cache: bool = O_RESET, slo: str | None = O_SLO, backend: str = O_BACKEND,
    ignore_eos: bool = O_EOS, continuous_usage: bool = O_CUSAGE, timeout_s: float = O_TIMEOUT,
    extra_body: str | None = O_EXTRA, api_key: str | None = O_APIKEY,
) -> None:
    """Sweep concurrency or rate over one or more servers: CSV, Pareto frontier, SLO search, $/1M tokens.

    Exit 1 when every request of every point failed."""
    from firstlight.bench.load import LoadSpec
    from firstlight.bench.metrics import SLO
    from firstlight.bench.run import RunConfig
    from firstlight.bench.sweep import Sweep, SweepSpec, parse_servers, parse_values
    from firstlight.errors import FirstlightError

    SLO.parse(slo)
    if concurrency and rate:
        raise FirstlightError("give --concurrency or --rate, not both.")
    mode = "rate" if rate else "concurrency"
    values = parse_values(rate or concurrency, f"--{mode}")
    if not values and not slo:
        raise FirstlightError("give the loads to sweep (--concurrency 1,4,16 or --rate 1,2,4) or an --slo to search.")
    load = LoadSpec(mode=mode, arrival=arrival, burstiness=burstiness, max_concurrency=max_concurrency,
                    ramp_up_s=ramp_up_s, num_requests=num_requests, warmup_requests=warmup_requests,
                    warmup_s=warmup_s, duration_s=duration_s, seed=seed)
    base = RunConfig(url="", workload=_workload(workload, input_len, output_len, prompts, num_groups, prefix_len,
                                                num_turns, tokenizer, seed, cache_bust),
                     load=load, endpoint=endpoint, model=model, slo=slo, backend=backend,
                     reset_prefix_cache=reset_prefix_cache, ignore_eos=ignore_eos, continuous_usage=continuous_usage,
                     extra_body=_extra(extra_body), request_timeout_s=timeout_s, api_key=api_key)
    spec = SweepSpec(servers=parse_servers(url, label, usd_per_hour), mode=mode, values=values, base=base,
                     search=search, slo_attainment=slo_attainment, max_search_points=max_search_points)
    from firstlight.core.progress import progress

    num_points = len(values) * len(spec.servers) + (max_search_points * len(spec.servers) if slo and search else 0)
    with progress("bench sweep", total=num_points, unit="points") as advance:
        result = Sweep(spec, out, resume=resume, on_point=lambda label, value: advance(1)).run()
    if result["points"] and all(not p.get("num_ok") for p in result["points"]):
        raise FirstlightError(f"every request of every sweep point failed; see {out}/points/*/requests.jsonl.")
    for lab, s in result["slo_search"].items():
        print(f"{lab}: highest {mode} meeting {s['slo']} (attainment >= {s['slo_attainment_target']}): "
              f"{s['max_load_meeting_slo']} (lowest failing: {s['lowest_failing_load']})")
    print(f"wrote {out}/sweep.csv, points.jsonl, result.json, *.png, index.html")


@app.command()
def compare(
    a: Path = typer.Argument(..., help="Output dir of the baseline run."),
    b: Path = typer.Argument(..., help="Output dir of the run compared to it."),
    confidence: float = typer.Option(0.95, help="Confidence level of the intervals."),
    resamples: int = typer.Option(2000, help="Bootstrap resamples."),
    seed: int = typer.Option(0, help="Bootstrap seed."),
    json_out: Path | None = typer.Option(None, "--json", help="Also write the comparison here."),
    allow_different: bool = typer.Option(False, "--allow-different",
                                         help="Compare runs whose workload or load differ (listed as warnings)."),
) -> None:
    """B - A for latency statistics with bootstrap CIs; marks which differences are significant.

    Refuses runs with different workloads or loads (see --allow-different); a tail statistic with too
    few requests behind it (p99 < 500, p90 < 50) is never called significant."""
    import sys

    from firstlight.bench.compare import compare_runs

    r = compare_runs(a, b, num_resamples=resamples, confidence=confidence, seed=seed, allow_different=allow_different)
    for w in r["differences"] + r["warnings"]:
        print(f"warning: {w}", file=sys.stderr)
    print(f"B - A ({r['method']}; {100 * confidence:g}% CI; n = {r['num_requests']})")
    print(f"{'metric':14s} {'stat':6s} {'A':>10s} {'B':>10s} {'B-A':>10s} {'CI low':>10s} {'CI high':>10s}  significant")
    for x in r["latency"]:
        print(f"{x['metric']:14s} {x['stat']:6s} {x['a']:10.3f} {x['b']:10.3f} {x['diff']:+10.3f} {x['ci_low']:+10.3f} "
              f"{x['ci_high']:+10.3f}  {'YES' if x['significant'] else ('n/a (too few)' if x.get('too_few_samples') else 'no')}")
    for x in r["throughput"]:
        print(f"{x['metric']:21s} A={x['a']:.3f} B={x['b']:.3f} B-A={x['diff']:+.3f} ({x['note']})")
    if json_out:
        json_out.write_text(json.dumps(r, indent=2))


@app.command()
def calibrate(
    concurrency: str = typer.Option("1,16,64,128", help="Concurrencies at which to measure the bias."),
    first_token_ms: float = typer.Option(50.0, help="Injected TTFT."),
    per_token_ms: float = typer.Option(10.0, help="Injected time per output token."),
    requests: int = typer.Option(384, help="Measured requests per concurrency."),
    backend: str = O_BACKEND,
    json_out: Path | None = typer.Option(None, "--json", help="Also write the calibration here."),
) -> None:
    """Measure this client's bias and capacity against the built-in reference server; store it."""
    from firstlight.bench.calibrate import calibrate as do_calibrate
    from firstlight.bench.calibrate import format_calibration
    from firstlight.bench.sweep import parse_values

    concs = [int(v) for v in parse_values(concurrency, "--concurrency")]
    r = do_calibrate(concurrencies=concs, first_token_ms=first_token_ms, per_token_ms=per_token_ms,
                     requests_per_point=requests, backend=backend)
    print(format_calibration(r))
    if json_out:
        json_out.write_text(json.dumps(r, indent=2, default=str))


@app.command("reference-server")
def reference_server(
    port: int = typer.Option(8001, help="Port on 127.0.0.1."),
    first_token_ms: float = typer.Option(10.0, help="Injected time to first token, ms."),
    per_token_ms: float = typer.Option(2.0, help="Injected time per further token, ms."),
    tokens_per_chunk: int = typer.Option(1, help="Tokens per streamed chunk."),
    default_max_tokens: int = typer.Option(16, help="Output tokens when a request gives no max_tokens."),
    error_rate: float = typer.Option(0.0, help="Fraction of requests answered with --error-status."),
    error_status: int = typer.Option(500, help="HTTP status of the injected errors."),
    early_close_rate: float = typer.Option(0.0, help="Fraction of streams cut."),
    seed: int = typer.Option(0, help="Seed of the injected errors and cuts."),
) -> None:
    """Serve the reference OpenAI-compatible server with exact injected delays (foreground)."""
    from firstlight.bench.reference import main as ref_main

    ref_main(["--port", str(port), "--first-token-ms", str(first_token_ms), "--per-token-ms", str(per_token_ms),
              "--tokens-per-chunk", str(tokens_per_chunk), "--default-max-tokens", str(default_max_tokens),
              "--error-rate", str(error_rate), "--error-status", str(error_status),
              "--early-close-rate", str(early_close_rate), "--seed", str(seed)])
