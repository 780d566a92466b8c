"""Predictions next to published measurements (docs/VALIDATION.md is this table).

Every row uses the hardware spec's own `efficiency` block, unchanged: nothing is tuned per row.
Regenerate: `firstlight sim validate --markdown`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from firstlight.core.batch import Batch, ScheduledSeq
from firstlight.core.hardware import load_spec
from firstlight.sim.collectives import bus_bandwidth_factor, collective_time
from firstlight.sim.cost import CostModel
from firstlight.sim.model import load_model
from firstlight.sim.parallel import ParallelConfig
from firstlight.sim.serve import ServeConfig, run_serve
from firstlight.sim.workload import Workload

NEMO = ("NVIDIA NeMo Framework user guide, performance/llama.html: Llama-2 inference, input 128 / output 20 "
        "tokens, average latency (ms)")
TRTLLM_OVERVIEW = ("NVIDIA/TensorRT-LLM docs/source/performance/perf-overview.md (v1.0 docs, commit 00f3768): "
                   "trtllm-bench throughput, infinite request rate, fixed ISL/OSL, Total Output Throughput")
TRTLLM_V09 = ("NVIDIA/TensorRT-LLM docs/source/performance.md, 'Low Latency' tables (data generated with v0.9.0): "
              "batch 1, 1st token latency, gptSessionBenchmark with output length 1")
GPT_FAST = ("pytorch-labs/gpt-fast README: Mixtral 8x7B bf16, batch 1, tokens/s on 8xA100-80GB "
            "(power-limited to 330 W)")


@dataclass(frozen=True)
class Row:
    what: str
    kind: str  # decode | prefill+decode | throughput | collective
    unit: str
    measured: float
    source: str
    predict: Callable[[], float]


def _request_latency_s(model: str, hw: str, tp: int, batch: int, prompt: int, output: int) -> float:
    """A static batch: one prefill step of all prompts, then output-1 decode steps."""
    cm = CostModel(load_model(model), load_spec(hw), ParallelConfig(tp=tp))
    t = cm.time(Batch(tuple(ScheduledSeq(f"p{i}", prompt, 0, prompt) for i in range(batch))))
    for k in range(1, output):
        t += cm.time(Batch(tuple(ScheduledSeq(f"p{i}", 1, prompt + k - 1, prompt) for i in range(batch))))
    return t


def _decode_tokens_per_s(model: str, hw: str, tp: int, ep: int = 1, ctx: int = 64) -> float:
    cm = CostModel(load_model(model), load_spec(hw), ParallelConfig(tp=tp, ep=ep))
    return 1.0 / cm.time(Batch((ScheduledSeq("r", 1, ctx, 5),)))


def _busbw_gbps(hw: str, nbytes: float = 8e9, p: int = 8, algorithm: str = "ring") -> float:
    spec = load_spec(hw)
    link = spec.links.scale_up
    assert link is not None
    alpha = link.latency_s + spec.efficiency.collective_overhead_us * 1e-6
    t = collective_time("all_reduce", nbytes, p, alpha, link.bandwidth_bytes_per_s * spec.efficiency.network, algorithm)
    return nbytes / t * bus_bandwidth_factor("all_reduce", p) / 1e9


def _offline_output_tokens_per_s(model: str, hw: str, tp: int, isl: int, osl: int, num_requests: int,
                                  dtype: str = "fp8") -> float:
    """trtllm-bench's throughput scenario through the serving simulator: every request queued at t=0,
    continuous batching (max 2048 seqs, 8192 batched tokens), KV capacity from the memory plan."""
    n = num_requests
    wl = Workload(np.zeros(n), np.full(n, isl, dtype=np.int64), np.full(n, osl, dtype=np.int64))
    cfg = ServeConfig(tp=tp, max_num_seqs=2048, max_num_batched_tokens=8192)
    result, _ = run_serve(load_model(model, weight_dtype=dtype, kv_dtype=dtype), load_spec(hw), wl, cfg)
    return float(result["throughput"]["output_tokens_per_s"])


def _ttft_ms(model: str, hw: str, tp: int, isl: int, dtype: str) -> float:
    """One request of `isl` prompt tokens into an idle replica: its TTFT from the serving simulator."""
    wl = Workload(np.zeros(1), np.array([isl], dtype=np.int64), np.array([1], dtype=np.int64))
    result, _ = run_serve(load_model(model, weight_dtype=dtype, kv_dtype=dtype), load_spec(hw), wl,
                          ServeConfig(tp=tp))
    return float(result["ttft_s"]["p50"]) * 1e3


def _trt(model: str, hw: str, tp: int, isl: int, osl: int, n: int) -> Callable[[], float]:
    return lambda: _offline_output_tokens_per_s(model, hw, tp, isl, osl, n)


def _nemo(hw: str, tp: int, batch: int) -> Callable[[], float]:
    return lambda: _request_latency_s("llama-2-7b", hw, tp, batch, 128, 20) * 1e3


ROWS: list[Row] = [
    Row("Llama-2-7B fp16, A100-80GB, TP1, batch 1, 128 in / 20 out", "prefill+decode", "ms", 234.0, NEMO,
        _nemo("a100-80gb", 1, 1)),
    Row("Llama-2-7B fp16, H100-SXM, TP1, batch 1, 128 in / 20 out", "prefill+decode", "ms", 153.8, NEMO,
        _nemo("h100-sxm", 1, 1)),
    Row("Llama-2-7B fp16, A100-80GB, TP1, batch 8, 128 in / 20 out", "prefill+decode", "ms", 329.5, NEMO,
        _nemo("a100-80gb", 1, 8)),
    Row("Llama-2-7B fp16, H100-SXM, TP1, batch 8, 128 in / 20 out", "prefill+decode", "ms", 199.2, NEMO,
        _nemo("h100-sxm", 1, 8)),
    Row("Llama-2-7B fp16, A100-80GB, TP8, batch 1, 128 in / 20 out", "prefill+decode", "ms", 136.5, NEMO,
        _nemo("a100-80gb", 8, 1)),
    Row("Llama-2-7B fp16, H100-SXM, TP8, batch 1, 128 in / 20 out", "prefill+decode", "ms", 97.6, NEMO,
        _nemo("h100-sxm", 8, 1)),
    Row("Llama-2-7B fp16, H100-SXM, TP1, batch 8: sentences/s", "throughput", "req/s", 40.2, NEMO,
        lambda: 8 / _request_latency_s("llama-2-7b", "h100-sxm", 1, 8, 128, 20)),
    Row("Mixtral-8x7B bf16 decode, 2xA100, TP2, batch 1", "decode", "tok/s", 96.67, GPT_FAST,
        lambda: _decode_tokens_per_s("mixtral-8x7b", "a100-80gb", 2)),
    Row("Mixtral-8x7B bf16 decode, 4xA100, TP4, batch 1", "decode", "tok/s", 155.35, GPT_FAST,
        lambda: _decode_tokens_per_s("mixtral-8x7b", "a100-80gb", 4)),
    Row("Mixtral-8x7B bf16 decode, 8xA100, TP8, batch 1", "decode", "tok/s", 227.82, GPT_FAST,
        lambda: _decode_tokens_per_s("mixtral-8x7b", "a100-80gb", 8)),
    Row("Llama-2-7B fp8 prefill, H100-SXM, TP1, batch 1, 2048-token prompt: TTFT", "prefill", "ms", 30.8,
        TRTLLM_V09, lambda: _ttft_ms("llama-2-7b", "h100-sxm", 1, 2048, "fp8")),
    Row("Llama-2-7B fp16 prefill, A100-80GB, TP1, batch 1, 2048-token prompt: TTFT", "prefill", "ms", 132.4,
        TRTLLM_V09, lambda: _ttft_ms("llama-2-7b", "a100-80gb", 1, 2048, "fp16")),
    Row("Llama-2-70B fp8 prefill, H100-SXM, TP8, batch 1, 2048-token prompt: TTFT", "prefill", "ms", 85.1,
        TRTLLM_V09, lambda: _ttft_ms("llama-2-70b", "h100-sxm", 8, 2048, "fp8")),
    Row("Llama-2-70B fp8 prefill, H200, TP4, batch 1, 2048-token prompt: TTFT", "prefill", "ms", 103.0,
        TRTLLM_V09, lambda: _ttft_ms("llama-2-70b", "h200", 4, 2048, "fp8")),
    Row("Llama-2-70B fp16 prefill, A100-80GB, TP8, batch 1, 2048-token prompt: TTFT", "prefill", "ms", 249.2,
        TRTLLM_V09, lambda: _ttft_ms("llama-2-70b", "a100-80gb", 8, 2048, "fp16")),
    Row("Llama-3.1-8B fp8, H100-SXM, TP1, 3000 req 128 in / 2048 out, all queued at t=0", "throughput", "out tok/s",
        22714, TRTLLM_OVERVIEW, _trt("llama-3.1-8b", "h100-sxm", 1, 128, 2048, 3000)),
    Row("Llama-3.1-8B fp8, H200, TP1, 3000 req 1000 in / 1000 out, all queued at t=0", "throughput", "out tok/s",
        17744, TRTLLM_OVERVIEW, _trt("llama-3.1-8b", "h200", 1, 1000, 1000, 3000)),
    Row("Llama-3.1-8B fp8, H100-SXM, TP1, 3000 req 2048 in / 128 out (prefill-heavy), all queued at t=0",
        "throughput", "out tok/s", 3450, TRTLLM_OVERVIEW, _trt("llama-3.1-8b", "h100-sxm", 1, 2048, 128, 3000)),
    Row("Llama-3.3-70B fp8, H200, TP1, 3000 req 500 in / 2000 out, all queued at t=0", "throughput", "out tok/s",
        3666, TRTLLM_OVERVIEW, _trt("llama-3.1-70b", "h200", 1, 500, 2000, 3000)),
    Row("Llama-3.3-70B fp8, H100-SXM, TP2, 3000 req 1000 in / 1000 out, all queued at t=0", "throughput",
        "out tok/s", 4205, TRTLLM_OVERVIEW, _trt("llama-3.1-70b", "h100-sxm", 2, 1000, 1000, 3000)),
    Row("Llama-3.3-70B fp8, H100-SXM, TP2, 1500 req 5000 in / 500 out (prefill-heavy), all queued at t=0",
        "throughput", "out tok/s", 898, TRTLLM_OVERVIEW, _trt("llama-3.1-70b", "h100-sxm", 2, 5000, 500, 1500)),
    Row("Llama-3.1-405B fp8, H200, TP8, 3000 req 1000 in / 1000 out, all queued at t=0", "throughput",
        "out tok/s", 3330, TRTLLM_OVERVIEW, _trt("llama-3.1-405b", "h200", 8, 1000, 1000, 3000)),
    Row("all_reduce busbw, 8xH100 NVLink, ring, large messages", "collective", "GB/s", 370.0,
        "NVIDIA/nccl-tests issue #212 (NCCL maintainer: ~370 GB/s effective NVLink busbw with NCCL_ALGO=RING)",
        lambda: _busbw_gbps("h100-sxm")),
    Row("all_reduce busbw, 8xA100-80GB NVLink, 1 GB", "collective", "GB/s", 200.0,
        "NVIDIA/nccl-tests issue #149 (8xA100-SXM4-80GB, HPE Apollo 6500: busbw ~200 GB/s)",
        lambda: _busbw_gbps("a100-80gb", 1e9)),
    Row("all_reduce busbw, 8xH200 NVLink (NCCL default: NVLS), 4 GB", "collective", "GB/s", 475.0,
        "NVIDIA/nccl-tests issue #272 (8xH200, NCCL 2.20.3: peak busbw 475 GB/s)",
        lambda: _busbw_gbps("h200", 4e9, algorithm="nvls")),
]


def run_validation() -> list[dict[str, Any]]:
    out = []
    for r in ROWS:
        pred = r.predict()
        out.append({"what": r.what, "kind": r.kind, "unit": r.unit, "measured": r.measured, "predicted": pred,
                    "error_pct": (pred - r.measured) / r.measured * 100, "source": r.source})
    return out


def to_markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| # | workload | kind | measured | predicted | error | source |", "|---|---|---|---|---|---|---|"]
    for i, r in enumerate(rows, 1):
        lines.append(f"| {i} | {r['what']} | {r['kind']} | {r['measured']:.4g} {r['unit']} | "
                     f"{r['predicted']:.4g} {r['unit']} | {r['error_pct']:+.1f}% | {r['source']} |")
    errs = sorted(abs(r["error_pct"]) for r in rows)
    lines.append("")
    lines.append(f"median |error| {errs[len(errs) // 2]:.1f}%, max |error| {errs[-1]:.1f}% over {len(rows)} rows")
    return "\n".join(lines)
