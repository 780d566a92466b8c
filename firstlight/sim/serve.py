"""Build a deployment (replicas, memory plan, KV transfer) from a config, run it, summarize the metrics."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from firstlight.core.hardware import HardwareSpec
from firstlight.sim.cluster import ClusterConfig
from firstlight.sim.cost import CostModel
from firstlight.sim.model import ModelDesc
from firstlight.sim.parallel import ParallelConfig, plan_memory
from firstlight.sim.serving import Replica, Requests, SchedulerConfig, SimConfigError, SimResult, simulate
from firstlight.sim.stack import StackCost, load_stack
from firstlight.sim.workload import Workload


class ServeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tp: int = Field(default=1, ge=1)
    pp: int = Field(default=1, ge=1)
    ep: int = Field(default=1, ge=1)
    num_replicas: int = Field(default=1, ge=1)  # data parallel; with disaggregation: unused
    num_prefill_replicas: int = Field(default=0, ge=0)  # > 0 turns on prefill/decode disaggregation
    num_decode_replicas: int = Field(default=0, ge=0)
    num_microbatches: int | None = Field(default=None, ge=1)  # pp > 1: per step; None = pp
    pipeline_schedule: str = "gpipe"  # gpipe | async
    max_num_batched_tokens: int = Field(default=8192, ge=1)
    max_num_seqs: int = Field(default=256, ge=1)
    block_size: int = Field(default=16, ge=1)
    memory_utilization: float = Field(default=0.9, gt=0, le=1)
    watermark: float = Field(default=0.01, ge=0, lt=1)  # free-KV fraction kept back at admission (vLLM)
    kv_capacity_tokens: int | None = Field(default=None, ge=1)  # override the memory plan
    router: str = "round_robin"
    kv_link: str = "scale_out"  # the link KV transfers cross: scale_up | scale_out
    cluster: ClusterConfig | None = None  # two-tier fabric: TP / EP collectives and KV transfers priced on it
    slo_ttft_s: float = Field(default=2.0, gt=0)
    slo_tpot_s: float = Field(default=0.1, gt=0)
    stack: str | None = None  # a serving-stack preset (sim/stacks/): graph padding, prefill buckets, batching mode
    mtp_acceptance: float | None = Field(default=None, ge=0, le=1)  # MTP speculation: i.i.d. draft acceptance
    mtp_tokens: int = Field(default=1, ge=1)  # drafted tokens per step (verify runs mtp_tokens + 1)


def _percentiles(x: np.ndarray, weights: np.ndarray | None = None) -> dict[str, float]:
    if x.size == 0:
        return {}
    if weights is None:
        qs = np.percentile(x, [50, 90, 95, 99])
        mean = float(x.mean())
    else:
        order = np.argsort(x)
        xs, cw = x[order], np.cumsum(weights[order])
        total = cw[-1]
        if total <= 0:
            return {}
        qs = [xs[np.searchsorted(cw, q / 100 * total)] for q in (50, 90, 95, 99)]
        mean = float((x * weights).sum() / total)
    return {"mean": mean, "p50": float(qs[0]), "p90": float(qs[1]), "p95": float(qs[2]), "p99": float(qs[3]),
            "max": float(x.max())}


def run_serve(model: ModelDesc, hw: HardwareSpec, workload: Workload, cfg: ServeConfig,
              cost_kwargs: dict[str, Any] | None = None) -> tuple[dict[str, Any], SimResult]:
    dp = cfg.num_prefill_replicas + cfg.num_decode_replicas if cfg.num_prefill_replicas else cfg.num_replicas
    par = ParallelConfig(tp=cfg.tp, pp=cfg.pp, ep=cfg.ep, dp=dp)
    stack = load_stack(cfg.stack) if cfg.stack else None
    kwargs = dict(cost_kwargs or {})
    if cfg.cluster is not None:
        need, have = par.num_devices, cfg.cluster.devices(hw)
        if need > have:
            raise SimConfigError(f"the deployment needs {need} devices (--tp x --pp x replicas) but the cluster has "
                                 f"{have} (--nodes x devices per node); add --nodes or lower the replicas")
        kwargs = {"cluster": cfg.cluster, **kwargs}
    if stack is not None and stack.step_overhead_us is not None:
        base = kwargs.get("efficiency") or hw.efficiency
        kwargs["efficiency"] = base.model_copy(update={"step_overhead_us": stack.step_overhead_us})
    cost = CostModel(model, hw, par, **kwargs)
    plan = plan_memory(model, hw, par, cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.memory_utilization)
    kv_tokens = cfg.kv_capacity_tokens or plan.kv_capacity_tokens
    longest = int((workload.num_prompt_tokens + workload.num_output_tokens).max())
    if longest > kv_tokens:
        raise SimConfigError(
            f"a request of {longest} tokens does not fit the KV cache of one replica ({kv_tokens} tokens); "
            "raise tp/pp or memory_utilization, or shorten the workload"
        )
    sched = SchedulerConfig(cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.block_size,
                            enable_chunked_prefill=stack.enable_chunked_prefill if stack else True,
                            inflight_batching=stack.inflight_batching if stack else True,
                            num_microbatches=cfg.num_microbatches or cfg.pp, pipeline_schedule=cfg.pipeline_schedule,
                            watermark=cfg.watermark)
    spec = None
    if cfg.mtp_acceptance is not None:  # decode steps verify k+1 tokens and yield E on average (speculative.py)
        from firstlight.sim.speculative import SpecCost, mtp_model

        draft = CostModel(mtp_model(model), hw, par.model_copy(update={"pp": 1}), **kwargs)  # on the last stage
        spec = SpecCost(cost, cfg.mtp_acceptance, cfg.mtp_tokens, draft)
    inner = spec or cost
    step_cost = StackCost(inner, stack) if stack is not None else inner
    reqs = Requests(workload)
    disagg = cfg.num_prefill_replicas > 0
    if disagg and cfg.num_decode_replicas < 1:
        raise SimConfigError("disaggregation needs num_decode_replicas >= 1 alongside num_prefill_replicas")
    n_front = cfg.num_prefill_replicas if disagg else cfg.num_replicas
    front = [Replica(i, step_cost, sched, kv_tokens, reqs, "prefill" if disagg else "both") for i in range(n_front)]
    back = [Replica(n_front + i, step_cost, sched, kv_tokens, reqs, "decode") for i in range(cfg.num_decode_replicas)] \
        if disagg else None
    kv_transfer = None
    if disagg:
        if cfg.kv_link not in ("scale_up", "scale_out"):
            raise SimConfigError(f"--kv-link {cfg.kv_link!r}: expected scale_up or scale_out")
        link = getattr(hw.links, cfg.kv_link)
        if cfg.cluster is not None and cfg.kv_link == "scale_out":
            # over the cluster's NICs, each device's share of oversubscribed uplinks
            _, _, nic_bw, lat = cfg.cluster.links(hw)
            bw = nic_bw / cfg.cluster.oversubscription * par.devices_per_replica
            if bw <= 0:
                raise SimConfigError(f"--kv-link scale_out: hardware {hw.name} has no NIC; give --nic-gbps")
        else:
            if link is None:
                raise SimConfigError(f"--kv-link {cfg.kv_link}: hardware {hw.name} has no {cfg.kv_link} link "
                                     "to carry KV transfers")
            # each device of the prefill replica sends its KV shard over its own link
            bw = link.bandwidth_bytes_per_s * hw.efficiency.network * par.devices_per_replica
            lat = link.latency_s
        prompts = reqs.prompt

        def kv_transfer(rid: int) -> float:
            return lat + model.kv_bytes_for_context(prompts[rid]) / bw

    t0 = time.perf_counter()
    res = simulate(workload, front, cfg.router, back, kv_transfer, cost.eff.request_overhead_us * 1e-6)
    wall = time.perf_counter() - t0
    result = summarize(res, workload, cfg, hw, par, plan.to_dict() | {"kv_capacity_tokens": kv_tokens}, wall)
    result["precision"] = model.profile.summary()
    result["stack"] = None if stack is None else {"name": stack.name, "source": stack.source}
    result["speculative"] = None if spec is None else spec.summary()
    return result, res


def summarize(res: SimResult, wl: Workload, cfg: ServeConfig, hw: HardwareSpec, par: ParallelConfig,
              memory: dict[str, Any], wall_s: float) -> dict[str, Any]:
    r = res.reqs
    arrival = np.asarray(r.arrival)
    first = np.asarray(r.first_token)
    finish = np.asarray(r.finish)
    out = wl.num_output_tokens.astype(np.float64)
    done = ~np.isnan(finish)
    ttft = (first - arrival)[done]
    e2e = (finish - arrival)[done]
    multi = done & (out > 1)
    tpot = ((finish - first)[multi] / (out[multi] - 1))
    durations = np.concatenate([np.asarray(rep.step_durations) for rep in res.replicas])
    decodes = np.concatenate([np.asarray(rep.step_decodes, dtype=np.float64) for rep in res.replicas])
    span = max(res.makespan_s - float(arrival[0]), 1e-12)
    out_tokens = float(out[done].sum())
    in_tokens = float(wl.num_prompt_tokens[done].sum())
    tpot_all = np.zeros(done.sum())
    tpot_all[(out[done] > 1)] = tpot
    good = (ttft <= cfg.slo_ttft_s) & (tpot_all <= cfg.slo_tpot_s)
    num_devices = len(res.replicas) * par.devices_per_replica
    price = hw.price_per_hour_usd
    cost_usd = None if price is None else num_devices * price * span / 3600
    return {
        "hardware": hw.name,
        "parallel": par.model_dump(),
        "config": cfg.model_dump(),
        "num_devices": num_devices,
        "num_requests": len(wl),
        "num_finished": int(done.sum()),
        "makespan_s": span,
        "ttft_s": _percentiles(ttft),
        "tpot_s": _percentiles(tpot),
        "itl_s": _percentiles(durations, decodes),
        "e2e_s": _percentiles(e2e),
        "throughput": {
            "requests_per_s": float(done.sum()) / span,
            "output_tokens_per_s": out_tokens / span,
            "total_tokens_per_s": (out_tokens + in_tokens) / span,
        },
        "goodput": {
            "slo_ttft_s": cfg.slo_ttft_s,
            "slo_tpot_s": cfg.slo_tpot_s,
            "fraction_meeting_slo": float(good.mean()) if good.size else 0.0,
            "requests_per_s": float(good.sum()) / span,
        },
        "utilization": [rep.busy_s / span for rep in res.replicas],
        "pipeline": _pipeline_summary(res, par, cfg),
        "num_steps": [rep.num_steps for rep in res.replicas],
        "max_running": [rep.max_running for rep in res.replicas],
        "num_preemptions": int(sum(r.num_preemptions)),
        "cost": {
            "usd": cost_usd,
            "usd_per_1m_output_tokens": None if cost_usd is None else cost_usd / out_tokens * 1e6,
            "usd_per_1m_total_tokens": None if cost_usd is None else cost_usd / (out_tokens + in_tokens) * 1e6,
        },
        "memory_per_device": memory,
        "sim": {"wall_s": wall_s, "num_events": res.num_events,
                "requests_per_wall_s": len(wl) / wall_s if wall_s > 0 else None},
    }


def _pipeline_summary(res: SimResult, par: ParallelConfig, cfg: ServeConfig) -> dict[str, Any] | None:
    """Bubble fraction: the share of non-overhead step time a stage sat idle."""
    if par.pp == 1:
        return None
    out = []
    for rep in res.replicas:
        span = rep.busy_s - rep.num_steps * rep.cost.step_s
        out.append(1.0 - rep.stage_busy_s / span if span > 0 else 0.0)
    return {"pp": par.pp, "num_microbatches": cfg.num_microbatches or par.pp, "schedule": cfg.pipeline_schedule,
            "bubble_fraction": out}


def figures(res: SimResult, wl: Workload) -> dict[str, Any]:
    """TTFT / TPOT / e2e CDFs and per-replica step-time series, as matplotlib figures."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = res.reqs
    arrival, first, finish = np.asarray(r.arrival), np.asarray(r.first_token), np.asarray(r.finish)
    out = wl.num_output_tokens
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.6))
    multi = out > 1
    series = {"TTFT (s)": first - arrival, "TPOT (s)": (finish - first)[multi] / (out[multi] - 1),
              "e2e latency (s)": finish - arrival}
    for ax, (name, x) in zip(axes, series.items(), strict=False):
        x = np.sort(x[~np.isnan(x)])
        if x.size:
            ax.plot(x, np.linspace(0, 1, x.size))
        ax.set_xlabel(name)
        ax.set_ylabel("CDF")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig2, ax2 = plt.subplots(figsize=(8, 3.2))
    for rep in res.replicas:
        ax2.plot(np.asarray(rep.step_durations) * 1e3, lw=0.5, label=f"replica {rep.idx} ({rep.role})")
    ax2.set_xlabel("step")
    ax2.set_ylabel("step time (ms)")
    ax2.legend(fontsize=7)
    return {"latency_cdfs": fig, "step_times": fig2}


def write_serve_report(out_dir: str | Path, result: dict[str, Any], res: SimResult, wl: Workload) -> Path:
    from firstlight.core.report import write_report

    rows = [{"metric": k, **v} for k, v in result.items() if k in ("ttft_s", "tpot_s", "itl_s", "e2e_s") and v]
    return write_report(out_dir, result, title=f"firstlight sim serve: {result['hardware']}",
                        figures=figures(res, wl), tables={"latency (s)": rows})
