"""`firstlight sim ...`: specs, precisions, stacks, model, fit, step, collective, serve, validate, replay, calibrate,
sweep, compare, longctx."""

from __future__ import annotations

import json
from pathlib import Path

import typer

app = typer.Typer(help="Predict performance: op costs, collectives, parallelism, serving simulation.", no_args_is_help=True)

HW = typer.Option("h100", "--hw", help="builtin spec name (see `firstlight sim specs`) or a spec YAML path")
MODEL = typer.Option("llama-3.1-8b", "--model", help="config.json path, checkpoint dir, or preset name")
PRECISION = typer.Option(None, "--precision", help="precision profile: builtin name (`firstlight sim precisions`) "
                         "or a YAML file; default: the checkpoint's dtype. --weight-dtype / --kv-dtype, if given too, "
                         "override the profile's weight groups / KV cache (its math rates stay)")
STACK = typer.Option(None, "--stack", help="serving-stack preset (`firstlight sim stacks`): trtllm, vllm, jetstream, "
                     "tt-metal, neuron; sets max batch, chunked prefill, graph/trace padding (explicit "
                     "--max-num-seqs / --max-num-batched-tokens / --block-size override its values)")
TP = typer.Option(1, "--tp", help="tensor-parallel degree (devices per model shard group)")
PP = typer.Option(1, "--pp", help="pipeline-parallel degree (stages per replica)")
EP = typer.Option(1, "--ep", help="expert-parallel degree for MoE layers; may exceed --tp (EP across replicas)")
WDT = typer.Option(None, "--weight-dtype", help="weight dtype: bf16, fp16, fp8, int8, int4, fp4, fp32 "
                   "(default: the config's torch_dtype); with --precision: overrides every weight group of the profile")
KVDT = typer.Option(None, "--kv-dtype", help="KV-cache dtype: bf16, fp16, fp8, int8, fp32 (default: the weight "
                    "dtype when 16-bit, else bf16); with --precision: overrides the profile's KV cache dtype")
MAX_SEQS = typer.Option(256, "--max-num-seqs", help="scheduler: most sequences running at once")
MAX_TOKENS = typer.Option(8192, "--max-num-batched-tokens", help="scheduler: token budget per step (chunked prefill)")
MEM_UTIL = typer.Option(0.9, "--memory-utilization", help="fraction of device memory for weights + activations + KV")
SLO = typer.Option("ttft=2s,tpot=100ms", help="p90 SLOs, as in `firstlight bench`: ttft=500ms,tpot=50 "
                   "(milliseconds unless suffixed with ms or s)")
# arrival names as in `firstlight bench --arrival`; the simulator's registry calls constant "uniform"
ARRIVAL_NAMES = {"poisson": "poisson", "gamma": "gamma", "constant": "uniform", "uniform": "uniform"}


def _load(model_name: str, precision: str | None = None, weight_dtype: str | None = None,
          kv_dtype: str | None = None, announce: bool = True):  # -> ModelDesc
    """The model at a precision profile (`--weight-dtype` / `--kv-dtype` override its storage groups); says which
    profile on stderr (JSON commands carry it in their output instead)."""
    from firstlight.core.hardware import DTYPE_BYTES
    from firstlight.errors import FirstlightError
    from firstlight.sim.model import load_model

    for opt, v in (("--weight-dtype", weight_dtype), ("--kv-dtype", kv_dtype)):
        if v is not None and v not in DTYPE_BYTES:
            raise FirstlightError(f"{opt} {v!r}: expected one of {sorted(DTYPE_BYTES)}")
    m = load_model(model_name, weight_dtype=weight_dtype, kv_dtype=kv_dtype, precision=precision)
    if announce:
        typer.echo(f"precision profile: {m.profile.describe()}", err=True)
    return m


def _stack_knobs(stack: str | None) -> dict:
    """The ServeConfig fields a serving-stack preset sets (none without one)."""
    if not stack:
        return {}
    from firstlight.sim.stack import load_stack

    return load_stack(stack).serve_fields()


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
def specs(show: str = typer.Option("", "--show", help="print one spec in full, every figure with its source"),
          sources: bool = typer.Option(False, "--sources", help="list every figure of every spec with its source")) -> None:
    """List the shipped chips and systems (chips, links, sources; --show NAME for one in full)."""
    from rich.console import Console
    from rich.table import Table

    from firstlight.core.hardware import builtin_spec_names, load_spec
    from firstlight.sim.system import tp_link

    if show:
        spec = load_spec(show)
        _print_json({**spec.model_dump(), "figures": spec.figures()})
        return
    if sources:
        t = Table("spec", "figure", "value", "source", show_lines=False)
        for name in builtin_spec_names():
            for f in load_spec(name).figures():
                t.add_row(name, f["path"], str(f["value"]), ("[estimate] " if f["estimate"] else "") + f["source"])
        Console(width=250).print(t)
        return
    t = Table("name", "kind", "chips", "bf16 TFLOP/s", "fp8", "fp4", "mem GiB", "mem GB/s", "TP link (whole box)",
              "GB/s/dir", "$/chip-h", "figures", "estimates")
    for name in builtin_spec_names():
        s = load_spec(name)
        up = s.links.scale_up
        link = tp_link(s, s.num_chips)
        via, bw = (link.via, link.bandwidth / 1e9) if link else ((up.name, up.bandwidth_gbps) if up else ("-", None))
        figs = s.figures()
        low = s.compute_tflops.get("fp4") or s.compute_tflops.get("nvfp4") or s.compute_tflops.get("mxfp4")
        t.add_row(name, "system" if s.system else "chip", str(s.num_chips), str(s.compute_tflops.get("bf16", "-")),
                  str(s.compute_tflops.get("fp8", "-")), str(low or "-"), f"{s.memory.capacity_gib:g}",
                  f"{s.memory.bandwidth_gbps:g}", via, f"{bw:g}" if bw else "-", str(s.price_per_hour_usd or "-"),
                  str(len(figs)), str(sum(f["estimate"] for f in figs)))
    Console(width=220).print(t)
    typer.echo("every figure has a source or an 'estimate' flag: `firstlight sim specs --sources`")


@app.command()
def precisions() -> None:
    """List the builtin precision profiles (dtype per tensor group, math rate, source)."""
    from firstlight.sim.precision import builtin_precisions, load_precision

    for n in builtin_precisions():
        p = load_precision(n)
        typer.echo(f"{p.describe()}\n    source: {p.source}")


@app.command()
def stacks() -> None:
    """List the serving-stack presets and what they set."""
    from firstlight.sim.stack import builtin_stacks, load_stack

    for n in builtin_stacks():
        st = load_stack(n)
        typer.echo(f"{n}: max_num_seqs {st.max_num_seqs}, max_num_batched_tokens {st.max_num_batched_tokens}, "
                   f"chunked prefill {st.enable_chunked_prefill}, in-flight {st.inflight_batching}, block "
                   f"{st.block_size}, graph/trace sizes {st.graph_capture_sizes[:4]}{'...' if len(st.graph_capture_sizes) > 4 else ''}"
                   f", prefill buckets {len(st.prefill_buckets)}\n    source: {st.source}")


@app.command()
def model(config: str = typer.Argument(..., help="config.json, checkpoint dir or preset name"),
          precision: str | None = PRECISION, weight_dtype: str | None = WDT, kv_dtype: str | None = KVDT) -> None:
    """Parameter count, KV bytes per token and FLOPs per token of a model."""
    _print_json(_load(config, precision, weight_dtype, kv_dtype, announce=False).summary())


@app.command()
def fit(hw: str = HW, model_name: str = MODEL, tp: int = TP, pp: int = PP, ep: int = EP,
        max_num_batched_tokens: int = MAX_TOKENS, max_num_seqs: int = MAX_SEQS, memory_utilization: float = MEM_UTIL,
        precision: str | None = PRECISION, weight_dtype: str | None = WDT, kv_dtype: str | None = KVDT) -> None:
    """Does the model fit on the devices? Weights, activations, KV capacity per device."""
    from firstlight.core.hardware import load_spec
    from firstlight.sim.parallel import ParallelConfig, plan_memory

    m = _load(model_name, precision, weight_dtype, kv_dtype, announce=False)
    plan = plan_memory(m, load_spec(hw), ParallelConfig(tp=tp, pp=pp, ep=ep),
                       max_num_batched_tokens, max_num_seqs, memory_utilization)
    # linear-attention/SSM layers: a fixed state per sequence beside the per-token KV (the plan holds the
    # state of max_num_seqs sequences back before sizing the KV)
    _print_json({**plan.to_dict(), "precision": m.profile.name, "state_bytes_per_seq": plan.state_bytes_per_seq,
                 "state_gb_at_max_num_seqs": plan.state_bytes / 1024**3})


@app.command()
def step(hw: str = HW, model_name: str = MODEL, tp: int = TP, pp: int = PP, ep: int = EP,
         batch: str = typer.Option("decode:32@1024", help="decode:N@CTX, prefill:TOKENS[@CACHED], comma-separated"),
         batch_json: Path | None = typer.Option(None, help="a Batch as JSON (core.Batch.to_dict)"),
         runner: str = typer.Option("fused", help="fused (one forward per step, vLLM-like) or grouped "
                                    "(firstlight's engine: one forward per chunk length)"),
         precision: str | None = PRECISION, weight_dtype: str | None = WDT, kv_dtype: str | None = KVDT) -> None:
    """Predicted time of one engine step, op by op, with the roofline bound of each."""
    from rich.console import Console
    from rich.table import Table

    from firstlight.core.batch import Batch
    from firstlight.core.hardware import load_spec
    from firstlight.sim.cost import CostModel
    from firstlight.sim.parallel import ParallelConfig

    b = Batch.from_dict(json.loads(batch_json.read_text())) if batch_json else parse_batch(batch)
    cm = CostModel(_load(model_name, precision, weight_dtype, kv_dtype), load_spec(hw),
                   ParallelConfig(tp=tp, pp=pp, ep=ep), runner=runner)
    t = Table("op", "GFLOP", "MB", "time ms", "bound",
              title=f"{cm.model.name} on {cm.hw.name} ({b.num_tokens} tokens, precision {cm.precision.name})")
    for op in cm.breakdown(b):
        t.add_row(op.name, f"{op.flops / 1e9:.2f}", f"{op.bytes / 1e6:.2f}", f"{op.time_s * 1e3:.3f}", op.bound)
    total = cm.time(b)
    Console().print(t)
    typer.echo(f"step time {total * 1e3:.3f} ms; {b.num_tokens / total:.0f} tokens/s")


NODES = typer.Option(None, "--nodes", help="cluster: scale-up domains (nodes); given, TP/EP collectives and KV "
                     "transfers are priced over the two-tier fabric")
PER_NODE = typer.Option(None, "--devices-per-node", help="cluster: devices per scale-up domain (default: the spec's)")
NETWORK = typer.Option("fat_tree", "--network", help="cluster scale-out: fat_tree | rail_optimized | none")
NIC = typer.Option(None, "--nic-gbps", help="cluster: NIC GB/s per device per direction (default: the spec's scale_out)")
OVERSUB = typer.Option(1.0, "--oversubscription", help="cluster: leaf uplink oversubscription (1 = non-blocking)")
SHARP = typer.Option(False, "--sharp/--no-sharp", help="cluster: in-network reduction on scale-out switches (CollNet)")


def _cluster(nodes: int | None, per_node: int | None, network: str, nic_gbps: float | None, oversubscription: float,
             sharp: bool, scale_up: str | None = None):  # -> ClusterConfig | None
    from firstlight.errors import FirstlightError
    from firstlight.sim.cluster import ClusterConfig

    if nodes is None:
        return None
    if network not in ("fat_tree", "rail_optimized", "none"):
        raise FirstlightError(f"--network {network!r}: expected fat_tree, rail_optimized or none")
    return ClusterConfig(num_nodes=nodes, devices_per_node=per_node, network=network, nic_gbps=nic_gbps,
                         oversubscription=oversubscription, sharp=sharp, scale_up=scale_up)


@app.command()
def collective(op: str = typer.Option("all_reduce", help="all_reduce | all_gather | reduce_scatter | all_to_all"),
               size: str = typer.Option("1GB", help="bytes per rank, e.g. 64KB, 1GB"),
               ranks: int = typer.Option(8, help="ranks taking part (with --nodes: default all devices)"),
               algorithm: str = typer.Option("ring", help="ring, tree, halving_doubling, hierarchical, pairwise, "
                                             "one_shot, nvls, or nccl (NCCL's tuner: algorithm x protocol)"),
               topology: str = typer.Option("switch", help="single domain: switch, full_mesh, ring, torus2d, torus3d, "
                                            "fat_tree, rail_optimized (with --nodes: the topology inside a node)"),
               hw: str = HW, bandwidth_gbps: float | None = typer.Option(None, help="override the link GB/s"),
               latency_us: float | None = typer.Option(None, help="override the link latency (us)"),
               nodes: int | None = NODES, devices_per_node: int | None = PER_NODE, network: str = NETWORK,
               nic_gbps: float | None = NIC, oversubscription: float = OVERSUB, sharp: bool = SHARP,
               table: bool = typer.Option(False, "--table", help="busbw per size 8KB..8GB for every NCCL algorithm "
                                          "and protocol, and NCCL's choice")) -> None:
    """Time and bus bandwidth of a collective: closed form, routed over the topology, and NCCL's model."""
    from firstlight.core.hardware import load_spec
    from firstlight.sim.cluster import ClusterConfig
    from firstlight.sim.collectives import bus_bandwidth_factor, get_algorithm, route_steps
    from firstlight.sim.collectives.nccl import busbw_table, choose
    from firstlight.sim.topology import build_topology

    nbytes = _parse_size(size)
    spec = load_spec(hw)
    cl = _cluster(nodes, devices_per_node, network, nic_gbps, oversubscription, sharp,
                  None if topology == "switch" else topology)
    if cl is not None and ranks == 8 and cl.devices(spec) != 8:
        ranks = cl.devices(spec)
    nccl_cl = cl or ClusterConfig(num_nodes=1, devices_per_node=ranks, nic_gbps=nic_gbps)
    link = spec.links.scale_up or spec.links.scale_out
    bw = (bandwidth_gbps * 1e9) if bandwidth_gbps else (link.bandwidth_bytes_per_s * spec.efficiency.network if link else 1e9)
    if bandwidth_gbps:
        spec = spec.model_copy(update={"links": spec.links.model_copy(update={"scale_up": (
            spec.links.scale_up or link).model_copy(update={"bandwidth_gbps": bandwidth_gbps / spec.efficiency.network})})})
    fab = nccl_cl.nccl_fabric(spec, ranks)
    if table:
        sizes = [8 * 2**10 * 8**i for i in range(7)] + [8 * 2**30]
        rows = busbw_table(op, fab, sizes)
        _print_json({"op": op, "ranks": ranks, "nodes": fab.num_nodes, "intra_gbps": fab.intra_bw / 1e9,
                     "inter_gbps": fab.inter_bw / 1e9, "busbw_gbps": rows})
        return
    lat = (latency_us * 1e-6) if latency_us is not None else (link.latency_s if link else 1e-6)
    alpha = lat + spec.efficiency.collective_overhead_us * 1e-6
    f = bus_bandwidth_factor(op, ranks)
    out: dict = {"op": op, "bytes": nbytes, "ranks": ranks, "algorithm": algorithm,
                 "link_bandwidth_gbps": bw / 1e9, "alpha_us": alpha * 1e6}
    if op != "all_to_all":
        a, proto, t = choose(op, nbytes, fab)
        out["nccl"] = {"algorithm": a, "protocol": proto, "time_s": t, "busbw_gbps": nbytes / t * f / 1e9}
    if algorithm == "nccl":
        _print_json(out)
        return
    alg = get_algorithm(algorithm)
    if cl is None:
        closed = alg.closed_form(op, ranks, nbytes, alpha, bw)
        out |= {"topology": topology, "closed_form_s": closed, "closed_form_busbw_gbps": nbytes / closed * f / 1e9}
        graph = build_topology(topology, ranks, bw, lat)
    else:
        graph = cl.graph(spec)
        out |= {"topology": graph.name, "nodes": cl.num_nodes, "network": cl.network}
    routed = route_steps(alg.steps(op, ranks, nbytes), graph, alpha=alpha - lat)
    out |= {"routed_s": routed.time_s, "routed_busbw_gbps": nbytes / routed.time_s * f / 1e9,
            "num_steps": routed.num_steps, "max_hops": routed.max_hops, "max_flows_per_link": routed.max_link_flows}
    _print_json(out)


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
          prefill_replicas: int = typer.Option(0, help="> 0: prefill/decode disaggregation with this many prefill replicas"),
          decode_replicas: int = typer.Option(0, help="with --prefill-replicas: decode replicas"),
          rate: float = typer.Option(4.0, help="requests per second (synthetic workload)"),
          num_requests: int = typer.Option(1000, help="requests in the synthetic workload"),
          arrival: str = typer.Option("poisson", help="poisson | gamma | constant (as `firstlight bench --arrival`)"),
          cv: float = typer.Option(1.0, help="gamma arrivals: coefficient of variation of inter-arrival times "
                                   "(1 = Poisson)"),
          trace: Path | None = typer.Option(None, help="an engine trace (`firstlight serve --trace`, .jsonl[.gz]): replay "
                                            "its requests with its engine settings and compare per-request latency "
                                            "with the measured; or a workload JSONL/CSV with arrival_s,"
                                            "num_prompt_tokens,num_output_tokens"),
          clock: str = typer.Option("wall", help="engine trace: compare on the wall clock, or `cpu` (steps re-timed "
                                    "to the engine thread's CPU time: a shared machine's contention removed)"),
          per_request: int = typer.Option(0, help="engine trace: print this many per-request rows"),
          prompt_len: int = typer.Option(512, help="mean prompt tokens (synthetic workload)"),
          output_len: int = typer.Option(128, help="mean output tokens (synthetic workload)"),
          len_dist: str = typer.Option("fixed", help="length distribution: fixed | uniform (+-50%) | exponential"),
          max_num_seqs: int | None = typer.Option(None, help="scheduler: most sequences running at once "
                                                  "(default 256, or the engine trace's)"),
          max_num_batched_tokens: int | None = typer.Option(None, help="scheduler: token budget per step "
                                                            "(default 8192, or the engine trace's)"),
          block_size: int | None = typer.Option(None, help="KV block size in tokens (default 16, or the trace's)"),
          kv_capacity_tokens: int | None = typer.Option(None, help="KV tokens per replica (default: the memory plan, "
                                                        "or the engine trace's blocks)"),
          runner: str | None = typer.Option(None, help="fused | grouped (default fused; grouped for a firstlight "
                                            "engine trace)"),
          router: str = typer.Option("round_robin", help="round_robin | least_outstanding"),
          slo: str = SLO,
          seed: int = typer.Option(0, help="workload random seed"),
          microbatches: int | None = typer.Option(None, help="pp > 1: micro-batches per step (default: pp)"),
          pipeline_schedule: str = typer.Option("gpipe", help="pp > 1: gpipe (flush each step) | async"),
          kv_link: str = typer.Option("scale_out", help="disaggregation: the link KV transfers cross, scale_up | "
                                      "scale_out (with --nodes: the cluster's NICs)"),
          nodes: int | None = NODES, devices_per_node: int | None = PER_NODE, network: str = NETWORK,
          nic_gbps: float | None = NIC, oversubscription: float = OVERSUB,
          precision: str | None = PRECISION, stack: str | None = STACK,
          weight_dtype: str | None = WDT, kv_dtype: str | None = KVDT,
          mtp_acceptance: float | None = typer.Option(None, help="MTP speculative decoding: the probability each "
                                                      "drafted token is accepted (i.i.d.); decode steps verify "
                                                      "--mtp-tokens + 1 tokens and yield (1-a^(k+1))/(1-a)"),
          mtp_tokens: int = typer.Option(1, help="with --mtp-acceptance: tokens the MTP layer drafts per step (k)"),
          out: Path | None = typer.Option(None, help="write a report directory (result.json, PNG plots)")) -> None:
    """Simulate serving a workload: latency distributions, throughput, goodput, utilization, $/1M tokens.

    With an engine trace as --trace, the trace's requests are the workload and its engine settings the
    deployment; any option given here overrides them (a what-if on other hardware or settings)."""
    from firstlight.core.hardware import load_spec
    from firstlight.sim.serve import ServeConfig, run_serve, write_serve_report
    from firstlight.sim.sweep import parse_slo
    from firstlight.sim.trace_replay import is_engine_trace
    from firstlight.sim.workload import load_trace, make_workload

    ttft, tpot = parse_slo(slo)
    arrival = _arrival(arrival)  # before the model loads: a bad name fails fast
    model = _load(model_name, precision, weight_dtype, kv_dtype)  # announced on stderr; the JSON carries it too
    spec = load_spec(hw)
    knobs = {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens, "block_size": block_size,
             "kv_capacity_tokens": kv_capacity_tokens}
    common = dict(tp=tp, pp=pp, ep=ep, num_replicas=replicas, num_prefill_replicas=prefill_replicas,
                  num_decode_replicas=decode_replicas, router=router, slo_ttft_s=ttft, slo_tpot_s=tpot,
                  num_microbatches=microbatches, pipeline_schedule=pipeline_schedule, kv_link=kv_link,
                  cluster=_cluster(nodes, devices_per_node, network, nic_gbps, oversubscription, False),
                  mtp_acceptance=mtp_acceptance, mtp_tokens=mtp_tokens)
    if trace is not None and is_engine_trace(trace):
        _serve_engine_trace(trace, model, spec, {**common, **_stack_knobs(stack),
                                                 **{k: v for k, v in knobs.items() if v is not None}},
                            runner, clock, per_request, out)
        return
    wl = load_trace(trace) if trace else make_workload(num_requests, rate, prompt_len, output_len, arrival, cv,
                                                       len_dist, seed)
    defaults = {"max_num_seqs": 256, "max_num_batched_tokens": 8192, "block_size": 16}
    # precedence: built-in defaults < the stack's knobs < options given here
    cfg = ServeConfig(**common, **{**defaults, **_stack_knobs(stack), **{k: v for k, v in knobs.items() if v is not None}})
    result, res = run_serve(model, spec, wl, cfg, {"runner": runner or "fused"})
    if out:
        write_serve_report(out, result, res, wl)
        typer.echo(f"report: {out}/index.html")
    keys = ("precision", "stack", "speculative", "num_devices", "num_finished", "makespan_s", "ttft_s", "tpot_s", "itl_s", "e2e_s",
            "throughput", "goodput", "utilization", "pipeline", "num_preemptions", "cost", "sim")
    _print_json({k: result[k] for k in keys})


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def _serve_engine_trace(path: Path, model, spec, overrides: dict, runner: str | None, clock: str,
                        per_request: int, out: Path | None) -> None:
    from rich.console import Console
    from rich.table import Table

    from firstlight.errors import FirstlightError
    from firstlight.sim.trace_replay import load_engine_trace, on_cpu_clock, replay_serve

    if clock not in ("wall", "cpu"):
        raise FirstlightError(f"--clock {clock!r}: expected wall or cpu")
    tr = load_engine_trace(path)
    if clock == "cpu":
        tr = on_cpu_clock(tr)
    if runner:
        overrides["runner"] = runner
    r = replay_serve(tr, model, spec, overrides)
    t = Table("metric", "measured p50", "predicted p50", "measured p90", "predicted p90", "per-request median |err|",
              "p90 |err|", title=f"{path.name} replayed on {spec.name} ({r['trace']['num_requests']} requests, "
              f"{clock} clock, runner {r['runner']})")
    for key in ("ttft", "tpot", "e2e"):
        c = r["vs_measured"][key]
        if c:
            t.add_row(key.upper(), f"{c['measured_p50_s'] * 1e3:.1f} ms", f"{c['predicted_p50_s'] * 1e3:.1f} ms",
                      f"{c['measured_p90_s'] * 1e3:.1f} ms", f"{c['predicted_p90_s'] * 1e3:.1f} ms",
                      f"{c['median_abs_pct']:.1f}%", f"{c['p90_abs_pct']:.1f}%")
    st = r["vs_measured"]["step"]
    Console().print(t)
    typer.echo(f"steps: measured {st['measured_num_steps']} (median {st['measured_median_s'] * 1e3:.2f} ms, total "
               f"{st['measured_total_s']:.2f} s), predicted {st['predicted_num_steps']} (median "
               f"{st['predicted_median_s'] * 1e3:.2f} ms, total {st['predicted_total_s']:.2f} s)")
    if r["trace"]["requests_inferred_from_steps"]:
        typer.echo("note: the trace has no request lines (older engine); arrivals are the first step of each request")
    if per_request:
        rows = Table("request", "prompt", "output", "TTFT meas ms", "TTFT pred ms", "TPOT meas ms", "TPOT pred ms",
                     "e2e meas ms", "e2e pred ms")
        for q in r["requests"][:per_request]:
            f = _ms
            rows.add_row(q["request_id"][-12:], str(q["num_prompt_tokens"]), str(q["num_output_tokens"]),
                         f(q["measured_ttft_s"]), f(q["predicted_ttft_s"]), f(q["measured_tpot_s"]),
                         f(q["predicted_tpot_s"]), f(q["measured_e2e_s"]), f(q["predicted_e2e_s"]))
        Console().print(rows)
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / "result.json").write_text(json.dumps(r, indent=2, default=str))
        typer.echo(f"result: {out}/result.json")


@app.command()
def validate(markdown: bool = typer.Option(False, help="print the docs/VALIDATION.md table")) -> None:
    """Predictions next to published measurements, with the error of each row."""
    from firstlight.sim.validation import run_validation, to_markdown

    rows = run_validation()
    if markdown:
        typer.echo(to_markdown(rows))
    else:
        _print_json(rows)


TRACE = typer.Option(..., "--trace", help="engine trace JSONL[.gz] (firstlight.core.Trace), e.g. from the engine's --trace")


@app.command()
def replay(trace: Path = TRACE, hw: str = HW, model_name: str = MODEL, tp: int = TP, pp: int = PP,
           runner: str | None = typer.Option(None, help="fused | grouped (default: grouped for a firstlight trace)"),
           clock: str = typer.Option("wall", help="wall, or cpu: steps re-timed to the engine thread's CPU time"),
           limit: int = typer.Option(20, help="steps to print (all go to --out)"),
           precision: str | None = PRECISION, weight_dtype: str | None = WDT, kv_dtype: str | None = KVDT,
           out: Path | None = typer.Option(None, help="write every step as JSON")) -> None:
    """Re-price every recorded Batch with the cost model: predicted vs measured step time."""
    from rich.console import Console
    from rich.table import Table

    from firstlight.core.hardware import load_spec
    from firstlight.sim.calibrate import load_trace_steps
    from firstlight.sim.calibrate import replay as run_replay
    from firstlight.sim.parallel import ParallelConfig
    from firstlight.sim.trace_replay import on_cpu_clock

    tr = load_trace_steps(trace)
    if clock == "cpu":
        tr = on_cpu_clock(tr)
    r = run_replay(tr, _load(model_name, precision, weight_dtype, kv_dtype), load_spec(hw), ParallelConfig(tp=tp, pp=pp),
                   runner=runner)
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
def calibrate(trace: list[Path] = typer.Option(..., "--trace", help="engine trace(s) to fit on; repeat the option"),
              holdout: list[Path] = typer.Option([], "--holdout", help="engine trace(s) to report error on, not fitted"),
              hw: str = HW, model_name: str = MODEL, tp: int = TP, pp: int = PP,
              runner: str | None = typer.Option(None, help="fused | grouped (default: grouped for a firstlight trace)"),
              clock: str = typer.Option("auto", help="wall | cpu | auto (cpu when every step has CPU times)"),
              latency: bool = typer.Option(True, "--latency/--no-latency",
                                           help="also simulate each trace's requests: per-request TTFT/TPOT/e2e error"),
              precision: str | None = PRECISION, weight_dtype: str | None = WDT, kv_dtype: str | None = KVDT,
              json_out: Path | None = typer.Option(None, "--json", help="write the full result (fit, errors) as JSON"),
              out: Path = typer.Option(Path("calibrated.yaml"), help="calibrated spec YAML to write")) -> None:
    """Fit compute/memory efficiency and per-step / per-sequence / per-kernel overheads to engine traces;
    report the error in-sample and on held-out traces; write a calibrated spec."""
    from firstlight.core.hardware import load_spec
    from firstlight.sim.calibrate import calibrate as run_calibrate
    from firstlight.sim.calibrate import load_trace_steps, write_spec_yaml
    from firstlight.sim.parallel import ParallelConfig

    fit_traces = [load_trace_steps(t) for t in trace]
    held = [load_trace_steps(t) for t in holdout]
    if clock == "auto":
        clock = "cpu" if all(s.cpu_s for t in fit_traces + held for s in t.steps) else "wall"
    r = run_calibrate(fit_traces, _load(model_name, precision, weight_dtype, kv_dtype), load_spec(hw),
                      ParallelConfig(tp=tp, pp=pp), source=", ".join(p.name for p in trace), holdout=held,
                      runner=runner, latency=latency, clock=clock)
    write_spec_yaml(r["spec"], out)
    b, a, f = r["before"], r["after"], r["fit"]
    typer.echo(f"{r['num_steps']} steps in {r['num_traces']} trace(s) of {r['model']} on {r['hardware']} "
               f"({r['clock']} clock, runner {r['runner']})")
    typer.echo(f"fit: compute {f['compute']:.3f}, memory {f['memory']:.3f}, step overhead {f['step_overhead_us']:.0f} us, "
               f"per-seq {f['seq_overhead_us']:.0f} us, per-kernel {f['kernel_overhead_us']:.1f} us"
               + (f", one-row (GEMV) memory {f['gemv_memory']:.3f}" if f.get("gemv_memory") is not None else "")
               + f"; {r['efficiency']['overlap']} overlap; host "
               f"{r['host']['step_us']:.0f} us + {r['host']['seq_us']:.0f} us/seq")
    typer.echo(f"execute_s error before: median {b['median_abs_pct']:.1f}%, p90 {b['p90_abs_pct']:.1f}%")
    typer.echo(f"execute_s error after:  median {a['median_abs_pct']:.1f}%, p90 {a['p90_abs_pct']:.1f}%")
    for part in ("in_sample", "held_out"):
        if part not in r:
            continue
        e = r[part]["step"]
        typer.echo(f"{part.replace('_', '-')}: step time median |err| {e['median_abs_pct']:.1f}%, p90 "
                   f"{e['p90_abs_pct']:.1f}%")
        lat = r[part].get("latency", {}).get("all", {})
        for key in ("ttft", "tpot", "e2e"):
            if lat.get(key):
                typer.echo(f"{part.replace('_', '-')}: {key.upper()} per-request median |err| "
                           f"{lat[key]['median_abs_pct']:.1f}%, p90 {lat[key]['p90_abs_pct']:.1f}% "
                           f"({lat[key]['num_requests']} requests)")
    if json_out:
        json_out.write_text(json.dumps({k: v for k, v in r.items() if k != "spec"}, indent=2, default=str))
    typer.echo(f"calibrated spec: {out}")


@app.command()
def sweep(model_name: str = MODEL,
          hw: str = typer.Option("h100,h200,mi300x", "--hw", help="comma-separated spec names or YAML paths"),
          tp: str = typer.Option("1,2,4,8", help="comma-separated TP degrees"),
          pp: str = typer.Option("1", help="comma-separated PP degrees"),
          rate: str = typer.Option("4", help="comma-separated request rates (req/s)"),
          slo: str = SLO,
          num_requests: int = typer.Option(500, help="requests simulated per point"),
          prompt_len: int = typer.Option(512, help="mean prompt tokens"),
          output_len: int = typer.Option(128, help="mean output tokens"),
          len_dist: str = typer.Option("fixed", help="length distribution: fixed | uniform (+-50%) | exponential"),
          replicas: int = typer.Option(1, help="data-parallel replicas per point"),
          seed: int = typer.Option(0, help="workload random seed"),
          nodes: int | None = NODES, devices_per_node: int | None = PER_NODE, network: str = NETWORK,
          nic_gbps: float | None = NIC, oversubscription: float = OVERSUB,
          weight_dtype: str | None = WDT, kv_dtype: str | None = KVDT,
          workers: int | None = typer.Option(None, help="local processes (default: CPU count)"),
          ray: bool = typer.Option(False, "--ray", help="run the points as Ray tasks (needs `firstlight[ray]`); "
                                   "starts a local Ray cluster unless --ray-address is given"),
          ray_address: str | None = typer.Option(None, help="with --ray: join this cluster (ray://HOST:10001, "
                                                 "or auto for the one this machine is part of)"),
          precision: str | None = PRECISION, stack: str | None = STACK,
          out: Path | None = typer.Option(None, help="report directory: result.json, Pareto plot, index.html")) -> None:
    """Every (hardware, tp, pp, rate) through the serving simulator; table, Pareto plot, best config under SLO."""
    from rich.console import Console
    from rich.table import Table

    from firstlight.sim.sweep import (
        SweepSpec,
        best_meeting_slo,
        grid,
        parse_list,
        parse_slo,
        run_sweep,
        write_sweep_report,
    )

    ttft, tpot = parse_slo(slo)
    points = grid(parse_list(hw, str, "--hw"), parse_list(tp, int, "--tp"), parse_list(pp, int, "--pp"),
                  parse_list(rate, float, "--rate"))
    m = _load(model_name, precision, weight_dtype, kv_dtype, announce=False)  # fail here, not in every worker
    cl = _cluster(nodes, devices_per_node, network, nic_gbps, oversubscription, False)
    spec = SweepSpec(model_name, num_requests, prompt_len, output_len, len_dist=len_dist, seed=seed,
                     num_replicas=replicas, slo_ttft_s=ttft, slo_tpot_s=tpot, precision=precision, stack=stack,
                     weight_dtype=weight_dtype, kv_dtype=kv_dtype, serve_kwargs={"cluster": cl} if cl else {})
    typer.echo(f"precision profile: {m.profile.describe()}; stack: {stack or 'default'}")
    from firstlight.core.progress import progress

    with progress("sim sweep", total=len(points), unit="points") as advance:
        rows = run_sweep(points, spec, workers, ray or ray_address is not None, ray_address, advance)
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


@app.command()
def compare(model_name: str = typer.Option("llama-3.1-70b", "--model", help="config.json path, checkpoint dir, "
                                           "or preset name"),
            prompt_len: int = typer.Option(1024, help="prompt tokens per request"),
            output_len: int = typer.Option(1024, help="output tokens per request"),
            slo: str = SLO,
            num_requests: int = typer.Option(100, help="requests per simulated replica and rate"),
            systems: str = typer.Option("", help="comma-separated SYSTEM:PRECISION:STACK (default: every vendor)"),
            markdown: bool = typer.Option(False, help="print the docs/SIM.md table")) -> None:
    """One workload on every system at its vendor's precision and stack: throughput, latency, $/1M tokens."""
    from firstlight.sim.compare import DEFAULT_SYSTEMS, CompareSpec, evaluate_system, to_markdown
    from firstlight.sim.sweep import parse_slo

    ttft, tpot = parse_slo(slo)
    spec = CompareSpec(model_name, prompt_len, output_len, ttft, tpot, num_requests)
    todo = [tuple(x.split(":")) for x in systems.split(",") if x.strip()] if systems else DEFAULT_SYSTEMS
    rows = []
    for item in todo:
        if len(item) != 3:
            from firstlight.errors import FirstlightError

            raise FirstlightError(f"--systems item {':'.join(item)!r}: expected SYSTEM:PRECISION:STACK")
        rows.append(evaluate_system(*item, spec))
        typer.echo(f"done {item[0]}", err=True)
    typer.echo(to_markdown(rows, spec) if markdown else json.dumps(rows, indent=2, default=str))


@app.command()
def longctx(hw: str = HW, model_name: str = typer.Option("llama-3.1-70b", "--model", help="config.json path, "
                                                         "checkpoint dir, or preset name"),
            tp: int = TP,
            cp: str = typer.Option("1,2,4,8", help="comma-separated context-parallel degrees (ring attention)"),
            context: str = typer.Option("131072,262144,524288,1048576", help="comma-separated context lengths"),
            chunk: int = typer.Option(8192, help="prefill chunk (tokens per step)"),
            kv_offload_gbps: float | None = typer.Option(None, help="offload KV that does not fit to host memory over "
                                                         "a link of this many GB/s (PCIe 5 x16: ~64)"),
            memory_utilization: float = MEM_UTIL, precision: str | None = PRECISION,
            weight_dtype: str | None = WDT, kv_dtype: str | None = KVDT,
            nodes: int | None = NODES, devices_per_node: int | None = PER_NODE, network: str = NETWORK,
            nic_gbps: float | None = NIC) -> None:
    """Long context (100K-1M tokens) for TP x CP: TTFT of the whole prompt, one decode step, KV per device."""
    from rich.console import Console
    from rich.table import Table

    from firstlight.core.hardware import load_spec
    from firstlight.sim.cost import CostModel
    from firstlight.sim.parallel import DoesNotFitError, ParallelConfig, plan_memory
    from firstlight.sim.sweep import parse_list

    spec, model = load_spec(hw), _load(model_name, precision, weight_dtype, kv_dtype)
    cl = _cluster(nodes, devices_per_node, network, nic_gbps, 1.0, False)
    t = Table("context", "tp x cp", "devices", "KV GB/device", "KV on host", "TTFT s", "decode ms/token",
              title=f"{model.name} on {spec.name}: one request, prefill in {chunk}-token chunks")
    for n_ctx in parse_list(context, int, "--context"):
        for c in parse_list(cp, int, "--cp"):
            par = ParallelConfig(tp=tp, cp=c)
            try:
                plan = plan_memory(model, spec, par, chunk, 1, memory_utilization)
            except DoesNotFitError:
                t.add_row(f"{n_ctx:,}", f"{tp} x {c}", str(tp * c), "-", "weights do not fit", "-", "-")
                continue
            frac = max(0.0, 1 - plan.kv_capacity_tokens / n_ctx)
            if frac and kv_offload_gbps is None:
                t.add_row(f"{n_ctx:,}", f"{tp} x {c}", str(tp * c), f"{n_ctx * plan.kv_bytes_per_token / 1e9:.1f}",
                          "KV does not fit", "-", "-")
                continue
            cm = CostModel(model, spec, par, cluster=cl, host_kv_fraction=min(frac, 0.999),
                           host_kv_gbps=kv_offload_gbps or 64.0)
            ttft = sum(cm.step_time(min(chunk, n_ctx - d), 1, 0, 0.0, [(min(chunk, n_ctx - d), d)])
                       for d in range(0, n_ctx, chunk))
            decode = cm.step_time(1, 1, 1, float(n_ctx + 1))
            t.add_row(f"{n_ctx:,}", f"{tp} x {c}", str(tp * c), f"{n_ctx * plan.kv_bytes_per_token / 1e9:.1f}",
                      f"{frac:.0%}", f"{ttft:.2f}", f"{decode * 1e3:.1f}")
    Console(width=140).print(t)
    typer.echo("KV beyond device memory: give --kv-offload-gbps to keep it in host memory, or raise --cp")
