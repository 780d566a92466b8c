"""`firstlight sim ...`: specs, model, fit, step, collective, serve, validate, replay, calibrate, sweep."""

from __future__ import annotations

import json
from pathlib import Path

import typer

app = typer.Typer(help="Predict performance: op costs, collectives, parallelism, serving simulation.", no_args_is_help=True)

HW = typer.Option("h100", "--hw", help="builtin spec name (see `firstlight sim specs`) or a spec YAML path")
MODEL = typer.Option("llama-3.1-8b", "--model", help="config.json path, checkpoint dir, or preset name")
TP = typer.Option(1, help="tensor-parallel degree")
PP = typer.Option(1, help="pipeline-parallel degree (stages)")
EP = typer.Option(1, help="expert-parallel degree (MoE models)")
MAX_BATCHED = typer.Option(8192, help="most tokens computed per step (chunked prefill)")
MAX_SEQS = typer.Option(256, help="most requests running at once")
NUM_REQUESTS = typer.Option(1000, help="requests to simulate")
PROMPT_LEN = typer.Option(512, help="mean prompt tokens")
OUTPUT_LEN = typer.Option(128, help="mean output tokens")
LEN_DIST = typer.Option("fixed", help="length distribution: fixed | uniform (+-50%) | exponential")
SEED = typer.Option(0, help="seed of arrivals and lengths")
SLO = typer.Option("ttft=2s,tpot=100ms", help="p90 SLOs, as in `firstlight bench`: ttft=500ms,tpot=50 "
                   "(milliseconds unless suffixed with ms or s)")
# arrival names as in `firstlight bench --arrival`; the simulator's registry calls constant "uniform"
ARRIVAL_NAMES = {"poisson": "poisson", "gamma": "gamma", "constant": "uniform", "uniform": "uniform"}


def _slo_seconds(text: str) -> tuple[float, float]:
    """(ttft, tpot) in seconds from the shared --slo syntax (firstlight/core/slo.py)."""
    from firstlight.core.slo import parse_slo_ms

    ms = {"ttft": 2000.0, "tpot": 100.0, **parse_slo_ms(text, ("ttft", "tpot"))}
    return ms["ttft"] / 1e3, ms["tpot"] / 1e3


def _arrival(name: str) -> str:
    from firstlight.errors import FirstlightError

    if name not in ARRIVAL_NAMES:
        raise FirstlightError(f"--arrival {name!r}: expected poisson, gamma or constant")
    return ARRIVAL_NAMES[name]


def _print_json(obj: object) -> None:
    typer.echo(json.dumps(obj, indent=2, default=str))


def parse_batch(text: str):  # -> Batch
    """`decode:64@1000,prefill:512@1024,prefill:2048`: N decode seqs at a context / chunk@cached prefills."""
    from firstlight.core.batch import Batch, ScheduledSeq
    from firstlight.errors import FirstlightError

    seqs: list[ScheduledSeq] = []
    for i, part in enumerate(p.strip() for p in text.split(",") if p.strip()):
        try:
            kind, rest = part.split(":", 1)
            num, _, at = rest.partition("@")
            n, c = int(num), int(at or 0)
        except ValueError:
            raise FirstlightError(f"--batch item {part!r}: expected decode:NUM_SEQS@CONTEXT or prefill:TOKENS[@CACHED]") from None
        if kind == "decode":
            seqs += [ScheduledSeq(f"d{i}.{j}", 1, c, min(c, 1)) for j in range(n)]
        elif kind == "prefill":
            seqs.append(ScheduledSeq(f"p{i}", n, c, c + n))
        else:
            raise FirstlightError(f"--batch item {part!r}: kind must be decode or prefill")
    if not seqs:
        raise FirstlightError("--batch is empty: e.g. --batch decode:64@1000,prefill:2048")
    return Batch(tuple(seqs))


@app.command()
def specs(show: str = typer.Option("", "--show", help="print one spec in full")) -> None:
    """List the shipped hardware specs (or print one with --show)."""
    from rich.console import Console
    from rich.table import Table

    from firstlight.core.hardware import builtin_spec_names, load_spec

    if show:
        _print_json(load_spec(show).model_dump())
        return
    t = Table("name", "bf16 TFLOP/s", "fp8 TFLOP/s", "mem GiB", "mem GB/s", "scale-up GB/s/dir", "W", "$/h")
    for name in builtin_spec_names():
        s = load_spec(name)
        up = s.links.scale_up
        t.add_row(name, str(s.compute_tflops.get("bf16", "-")), str(s.compute_tflops.get("fp8", "-")),
                  f"{s.memory.capacity_gib:g}", f"{s.memory.bandwidth_gbps:g}", f"{up.bandwidth_gbps:g}" if up else "-",
                  str(s.power_w or "-"), str(s.price_per_hour_usd or "-"))
    Console().print(t)


@app.command()
def model(config: str = typer.Argument(..., help="config.json, checkpoint dir or preset name")) -> None:
    """Parameter count, KV bytes per token and FLOPs per token of a model."""
    from firstlight.sim.model import load_model

    _print_json(load_model(config).summary())


@app.command()
def fit(hw: str = HW, model_name: str = MODEL, tp: int = TP, pp: int = PP, ep: int = EP,
        max_num_batched_tokens: int = MAX_BATCHED, max_num_seqs: int = MAX_SEQS,
        memory_utilization: float = typer.Option(0.9, help="fraction of device memory the engine may use")) -> None:
    """Does the model fit on the devices? Weights, activations, KV capacity per device."""
    from firstlight.core.hardware import load_spec
    from firstlight.sim.model import load_model
    from firstlight.sim.parallel import ParallelConfig, plan_memory

    plan = plan_memory(load_model(model_name), load_spec(hw), ParallelConfig(tp=tp, pp=pp, ep=ep),
                       max_num_batched_tokens, max_num_seqs, memory_utilization)
    _print_json(plan.to_dict())


@app.command()
def step(hw: str = HW, model_name: str = MODEL, tp: int = TP, pp: int = PP, ep: int = EP,
         batch: str = typer.Option("decode:32@1024", help="decode:N@CTX, prefill:TOKENS[@CACHED], comma-separated"),
         batch_json: Path | None = typer.Option(None, help="a Batch as JSON (core.Batch.to_dict)")) -> None:
    """Predicted time of one engine step, op by op, with the roofline bound of each."""
    from rich.console import Console
    from rich.table import Table

    from firstlight.core.batch import Batch
    from firstlight.core.hardware import load_spec
    from firstlight.sim.cost import CostModel
    from firstlight.sim.model import load_model
    from firstlight.sim.parallel import ParallelConfig

    b = Batch.from_dict(json.loads(batch_json.read_text())) if batch_json else parse_batch(batch)
    cm = CostModel(load_model(model_name), load_spec(hw), ParallelConfig(tp=tp, pp=pp, ep=ep))
    t = Table("op", "GFLOP", "MB", "time ms", "bound", title=f"{cm.model.name} on {cm.hw.name} ({b.num_tokens} tokens)")
    for op in cm.breakdown(b):
        t.add_row(op.name, f"{op.flops / 1e9:.2f}", f"{op.bytes / 1e6:.2f}", f"{op.time_s * 1e3:.3f}", op.bound)
    total = cm.time(b)
    Console().print(t)
    typer.echo(f"step time {total * 1e3:.3f} ms; {b.num_tokens / total:.0f} tokens/s")


@app.command()
def collective(op: str = typer.Option("all_reduce", help="all_reduce | all_gather | reduce_scatter | all_to_all"),
               size: str = typer.Option("1GB", help="bytes per rank, e.g. 64KB, 1GB"),
               ranks: int = typer.Option(8, help="ranks taking part"),
               algorithm: str = typer.Option("ring", help="collective algorithm (see sim/collectives/)"),
               topology: str = typer.Option("switch", help="switch, full_mesh, ring, torus2d, torus3d, fat_tree"),
               hw: str = HW,
               bandwidth_gbps: float | None = typer.Option(None, help="link bandwidth, GB/s (default: the spec's)"),
               latency_us: float | None = typer.Option(None, help="link latency, us (default: the spec's)")) -> None:
    """Time and bus bandwidth of a collective: alpha-beta closed form and routed over the topology."""
    from firstlight.core.hardware import load_spec
    from firstlight.sim.collectives import bus_bandwidth_factor, get_algorithm, route_steps
    from firstlight.sim.topology import build_topology

    nbytes = _parse_size(size)
    spec = load_spec(hw)
    link = spec.links.scale_up or spec.links.scale_out
    bw = (bandwidth_gbps * 1e9) if bandwidth_gbps else (link.bandwidth_bytes_per_s * spec.efficiency.network if link else 1e9)
    lat = (latency_us * 1e-6) if latency_us is not None else (link.latency_s if link else 1e-6)
    alpha = lat + spec.efficiency.collective_overhead_us * 1e-6
    alg = get_algorithm(algorithm)
    closed = alg.closed_form(op, ranks, nbytes, alpha, bw)
    graph = build_topology(topology, ranks, bw, lat)
    routed = route_steps(alg.steps(op, ranks, nbytes), graph, alpha=alpha - lat)
    f = bus_bandwidth_factor(op, ranks)
    _print_json({
        "op": op, "bytes": nbytes, "ranks": ranks, "algorithm": algorithm, "topology": topology,
        "link_bandwidth_gbps": bw / 1e9, "alpha_us": alpha * 1e6,
        "closed_form_s": closed, "closed_form_busbw_gbps": nbytes / closed * f / 1e9,
        "routed_s": routed.time_s, "routed_busbw_gbps": nbytes / routed.time_s * f / 1e9,
        "num_steps": routed.num_steps, "max_hops": routed.max_hops, "max_flows_per_link": routed.max_link_flows,
    })


def _parse_size(s: str) -> float:
    from firstlight.errors import FirstlightError

    units = {"KB": 1e3, "MB": 1e6, "GB": 1e9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}
    t = s.strip().upper()
    for u in sorted(units, key=len, reverse=True):
        if t.endswith(u):
            try:
                return float(t[: -len(u)]) * units[u]
            except ValueError:
                break
    try:
        return float(t)
    except ValueError:
        raise FirstlightError(f"--size {s!r}: expected a byte count like 65536, 64KB or 1GB") from None


@app.command()
def serve(hw: str = HW, model_name: str = MODEL, tp: int = TP, pp: int = PP, ep: int = EP,
          replicas: int = typer.Option(1, help="data-parallel replicas behind the router"),
          prefill_replicas: int = typer.Option(0, help="> 0: prefill/decode disaggregation"),
          decode_replicas: int = typer.Option(0, help="with --prefill-replicas: decode replicas"),
          rate: float = typer.Option(4.0, help="requests per second"), num_requests: int = NUM_REQUESTS,
          arrival: str = typer.Option("poisson", help="poisson | gamma | constant (as `firstlight bench --arrival`)"),
          cv: float = typer.Option(1.0, help="gamma arrivals: coefficient of variation (1 = Poisson)"),
          trace: Path | None = typer.Option(None, help="JSONL/CSV with arrival_s,num_prompt_tokens,num_output_tokens"),
          prompt_len: int = PROMPT_LEN, output_len: int = OUTPUT_LEN, len_dist: str = LEN_DIST,
          max_num_seqs: int = MAX_SEQS, max_num_batched_tokens: int = MAX_BATCHED,
          block_size: int = typer.Option(16, help="tokens per KV-cache block"),
          router: str = typer.Option("round_robin", help="how requests are spread over replicas"),
          slo: str = SLO, seed: int = SEED,
          microbatches: int | None = typer.Option(None, help="pp > 1: micro-batches per step (default: pp)"),
          pipeline_schedule: str = typer.Option("gpipe", help="pp > 1: gpipe (flush each step) | async"),
          out: Path | None = typer.Option(None, help="write a report directory (result.json, PNG plots)")) -> None:
    """Simulate serving a workload: latency distributions, throughput, goodput, utilization, $/1M tokens."""
    from firstlight.core.hardware import load_spec
    from firstlight.sim.model import load_model
    from firstlight.sim.serve import ServeConfig, run_serve, write_serve_report
    from firstlight.sim.workload import load_trace, make_workload

    slo_ttft, slo_tpot = _slo_seconds(slo)
    wl = load_trace(trace) if trace else make_workload(num_requests, rate, prompt_len, output_len, _arrival(arrival),
                                                       cv, len_dist, seed)
    cfg = ServeConfig(tp=tp, pp=pp, ep=ep, num_replicas=replicas, num_prefill_replicas=prefill_replicas,
                      num_decode_replicas=decode_replicas, max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=max_num_batched_tokens, block_size=block_size, router=router,
                      slo_ttft_s=slo_ttft, slo_tpot_s=slo_tpot, num_microbatches=microbatches,
                      pipeline_schedule=pipeline_schedule)
    result, res = run_serve(load_model(model_name), load_spec(hw), wl, cfg)
    if out:
        write_serve_report(out, result, res, wl)
        typer.echo(f"report: {out}/index.html")
    keys = ("num_devices", "num_finished", "makespan_s", "ttft_s", "tpot_s", "itl_s", "e2e_s", "throughput",
            "goodput", "utilization", "pipeline", "num_preemptions", "cost", "sim")
    _print_json({k: result[k] for k in keys})


@app.command()
def validate(markdown: bool = typer.Option(False, help="print the docs/VALIDATION.md table")) -> None:
    """Predictions next to published measurements, with the error of each row."""
    from firstlight.sim.validation import run_validation, to_markdown

    rows = run_validation()
    if markdown:
        typer.echo(to_markdown(rows))
    else:
        _print_json(rows)


TRACE = typer.Option(..., "--trace", help="engine trace JSONL (firstlight.core.Trace), e.g. from the engine's --trace")


@app.command()
def replay(trace: Path = TRACE, hw: str = HW, model_name: str = MODEL, tp: int = TP, pp: int = PP,
           limit: int = typer.Option(20, help="steps to print (all go to --out)"),
           out: Path | None = typer.Option(None, help="write every step as JSON")) -> None:
    """Re-price every recorded Batch with the cost model: predicted vs measured step time."""
    from rich.console import Console
    from rich.table import Table

    from firstlight.core.hardware import load_spec
    from firstlight.sim.calibrate import load_trace_steps
    from firstlight.sim.calibrate import replay as run_replay
    from firstlight.sim.model import load_model
    from firstlight.sim.parallel import ParallelConfig

    r = run_replay(load_trace_steps(trace), load_model(model_name), load_spec(hw), ParallelConfig(tp=tp, pp=pp))
    t = Table("step", "seqs", "prefill tok", "decode tok", "measured execute ms", "measured total ms", "predicted ms",
              "error", title=f"{r['model']} on {r['hardware']}: {r['num_steps']} steps")
    for row in r["steps"][:limit]:
        err = (row["predicted_s"] - row["measured_execute_s"]) / row["measured_execute_s"] * 100
        t.add_row(str(row["step"]), str(row["num_seqs"]), str(row["num_prefill_tokens"]), str(row["num_decode_tokens"]),
                  f"{row['measured_execute_s'] * 1e3:.3f}", f"{row['measured_total_s'] * 1e3:.3f}",
                  f"{row['predicted_s'] * 1e3:.3f}", f"{err:+.1f}%")
    Console().print(t)
    for what in ("vs_execute", "vs_total"):
        e = r[what]
        typer.echo(f"predicted {what}: median |err| {e['median_abs_pct']:.1f}%, p90 |err| {e['p90_abs_pct']:.1f}%, "
                   f"total predicted {e['total_pred_s']:.3f} s vs measured {e['total_meas_s']:.3f} s")
    if out:
        out.write_text(json.dumps(r, indent=2))
        typer.echo(f"steps: {out}")


@app.command()
def calibrate(trace: Path = TRACE, hw: str = HW, model_name: str = MODEL, tp: int = TP, pp: int = PP,
              out: Path = typer.Option(Path("calibrated.yaml"), help="calibrated spec YAML to write")) -> None:
    """Fit compute/memory efficiency and per-step overhead to a trace's execute_s; write a calibrated spec."""
    from firstlight.core.hardware import load_spec
    from firstlight.sim.calibrate import calibrate as run_calibrate
    from firstlight.sim.calibrate import load_trace_steps, write_spec_yaml
    from firstlight.sim.model import load_model
    from firstlight.sim.parallel import ParallelConfig

    r = run_calibrate(load_trace_steps(trace), load_model(model_name), load_spec(hw), ParallelConfig(tp=tp, pp=pp),
                      source=str(trace))
    write_spec_yaml(r["spec"], out)
    b, a, f = r["before"], r["after"], r["fit"]
    typer.echo(f"{r['num_steps']} steps of {r['model']} on {r['hardware']}")
    typer.echo(f"fit: compute {f['compute']:.3f}, memory {f['memory']:.3f}, step overhead "
               f"{f['step_overhead_us']:.0f} us (+ host {r['host_overhead_us']:.0f} us in the spec)")
    typer.echo(f"execute_s error before: median {b['median_abs_pct']:.1f}%, p90 {b['p90_abs_pct']:.1f}%")
    typer.echo(f"execute_s error after:  median {a['median_abs_pct']:.1f}%, p90 {a['p90_abs_pct']:.1f}%")
    typer.echo(f"calibrated spec: {out}")


@app.command()
def sweep(model_name: str = MODEL,
          hw: str = typer.Option("h100,h200,mi300x", "--hw", help="comma-separated spec names or YAML paths"),
          tp: str = typer.Option("1,2,4,8", help="comma-separated TP degrees"),
          pp: str = typer.Option("1", help="comma-separated PP degrees"),
          rate: str = typer.Option("4", help="comma-separated request rates (req/s)"),
          slo: str = SLO,
          num_requests: int = typer.Option(500, help="requests simulated per point"),
          prompt_len: int = PROMPT_LEN, output_len: int = OUTPUT_LEN, len_dist: str = LEN_DIST,
          replicas: int = typer.Option(1, help="data-parallel replicas per point"), seed: int = SEED,
          workers: int | None = typer.Option(None, help="local processes (default: CPU count)"),
          ray: bool = typer.Option(False, "--ray", help="run the points as Ray tasks (needs ray installed)"),
          out: Path | None = typer.Option(None, help="report directory: result.json, Pareto plot, index.html")) -> None:
    """Every (hardware, tp, pp, rate) through the serving simulator; table, Pareto plot, best config under SLO."""
    from rich.console import Console
    from rich.table import Table

    from firstlight.sim.sweep import (
        SweepSpec,
        best_meeting_slo,
        grid,
        parse_list,
        run_sweep,
        write_sweep_report,
    )

    ttft, tpot = _slo_seconds(slo)
    points = grid(parse_list(hw, str, "--hw"), parse_list(tp, int, "--tp"), parse_list(pp, int, "--pp"),
                  parse_list(rate, float, "--rate"))
    spec = SweepSpec(model_name, num_requests, prompt_len, output_len, len_dist=len_dist, seed=seed,
                     num_replicas=replicas, slo_ttft_s=ttft, slo_tpot_s=tpot)
    from firstlight.core.progress import status

    with status(f"sim sweep: {len(points)} points"):  # a per-point bar needs a callback in sim/sweep.py
        rows = run_sweep(points, spec, workers, ray)
    t = Table("hw", "tp", "pp", "rate", "devices", "p90 TTFT s", "p90 TPOT ms", "out tok/s", "$/1M out", "SLO",
              title=f"{model_name}: {len(rows)} points")
    for r in rows:
        if not r["fits"]:
            t.add_row(r["hw"], str(r["tp"]), str(r["pp"]), f"{r['rate']:g}", str(r["num_devices"]),
                      "-", "-", "-", "-", "does not fit" if "fit" in r["reason"] else r["reason"][:40])
            continue
        cost = r["usd_per_1m_output_tokens"]
        t.add_row(r["hw"], str(r["tp"]), str(r["pp"]), f"{r['rate']:g}", str(r["num_devices"]),
                  f"{r['ttft_p90_s']:.3f}", f"{r['tpot_p90_s'] * 1e3:.1f}", f"{r['output_tokens_per_s']:.0f}",
                  "-" if cost is None else f"{cost:.3f}", "yes" if r["meets_slo"] else "no")
    Console().print(t)
    best = best_meeting_slo(rows)
    if best:
        typer.echo(f"best meeting p90 TTFT <= {ttft:g} s and p90 TPOT <= {tpot * 1e3:g} ms: {best['hw']} tp={best['tp']} "
                   f"pp={best['pp']} at {best['rate']:g} req/s, ${best['usd_per_1m_output_tokens']:.3f} per 1M output tokens")
    else:
        typer.echo("no point meets the SLO")
    if out:
        write_sweep_report(out, rows, spec)
        typer.echo(f"report: {out}/index.html")
