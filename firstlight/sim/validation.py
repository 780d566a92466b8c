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
TT_PERF = ("tenstorrent/tt-metal models/tt_transformers/PERF.md (commit 040a27c1), Performance table: batch 1, "
           "t/s/u over 200 decode iterations, bfp4 MLP / bfp8 attention (the tt-performance profile)")
INTEL_G2 = ("Intel, Model Performance Data for Intel Gaudi 2 (SynapseAI 1.18.0, HLS-Gaudi2): LLM throughput, fp8, "
            "fixed batch, output tokens/s")
INTEL_G3 = ("Intel, Model Performance Data for Intel Gaudi 3 (SynapseAI 1.18.0, HLS-Gaudi3): LLM throughput, fp8, "
            "fixed batch, output tokens/s")
OCI_MI300X = ("Oracle Cloud blog 'Serving Llama 3.1 405B model with AMD MI300X GPUs' (BM.GPU.MI300X.8, vLLM "
              "benchmark_latency.py, FP8, 128 in / 128 out)")
GPT_FAST = ("pytorch-labs/gpt-fast README: Mixtral 8x7B bf16, batch 1, tokens/s on 8xA100-80GB "
            "(power-limited to 330 W)")
TRTLLM_PP = ("NVIDIA/TensorRT-LLM docs/source/performance/perf-overview.md (v1.0 docs, commit 00f3768), "
             "'RTX 6000 Pro Blackwell Server Edition' tables: trtllm-bench throughput, infinite request rate, "
             "FP4, 'N GPUs TPx,PPy', Total Output Throughput")
NIM_70B = ("NVIDIA NIM benchmarking docs, docs.nvidia.com/nim/benchmarking/llm/1.0.0/performance: "
           "Llama-3.3-70b-instruct NIM 1.8.0, '2 x H100 80G', 'fp8 TP2', '5000 Input Tokens / 500 Output Tokens', "
           "AIPerf at a fixed concurrency, 'ITL (ms)'")
NEURON_70B = ("aws-neuron/aws-neuron-sdk libraries/nxd-inference/tutorials/trn2-llama3.3-70b-tutorial.rst and "
              "llama70b_perf_comparison.csv (commit 06f3378): trn2.48xlarge, TP64 at LNC=2 (16 Trainium2), bf16, "
              "batch 1, vLLM max-num-seqs 1, LLMPerf 10000 in / 1500 out, 1 concurrent request, 50 requests")
NEURON_TRN1 = ("aws-neuron/aws-neuron-sdk about-neuron/benchmarks/trn1/latency_data_decoder.csv (commit 7c165a3): "
               "Llama-3-70B, Transformers NeuronX (Neuron 2.18.1), trn1.32xlarge, TP degree 32 (NeuronCores = 16 "
               "Trainium chips), batch 1, bf16 weights, Matmult-BF16, 'TTFT / TPOT Latency P50 (ms)'")
NEURON_405B = ("aws-neuron/aws-neuron-sdk libraries/nxd-inference/tutorials/trn2-llama3.1-405b-speculative-tutorial.rst "
               "(commit 2ae3525) and llama405b_perf_comparison.csv (commit ba1c08b), scenario 1 (bf16, no "
               "speculation): trn2.48xlarge, TP64 at LNC=2, batch 1, LLMPerf 10000 in / 1500 out requested "
               "(1785 generated, p50), 1 concurrent request, 50 requests")


@dataclass(frozen=True)
class Row:
    what: str
    kind: str  # decode | prefill | prefill+decode | throughput | pipeline | latency-under-load | collective
    unit: str
    measured: float
    source: str
    predict: Callable[[], float]


def _request_latency_s(model: str, hw: str, tp: int, batch: int, prompt: int, output: int,
                       precision: str | None = None) -> float:
    """A static batch: one prefill step of all prompts, then output-1 decode steps."""
    cm = CostModel(load_model(model, precision=precision), load_spec(hw), ParallelConfig(tp=tp))
    t = cm.time(Batch(tuple(ScheduledSeq(f"p{i}", prompt, 0, prompt) for i in range(batch))))
    for k in range(1, output):
        t += cm.time(Batch(tuple(ScheduledSeq(f"p{i}", 1, prompt + k - 1, prompt) for i in range(batch))))
    return t


def _decode_tokens_per_s(model: str, hw: str, tp: int, ep: int = 1, ctx: int = 64, precision: str | None = None,
                         ) -> float:
    cm = CostModel(load_model(model, precision=precision), load_spec(hw), ParallelConfig(tp=tp, ep=ep))
    return 1.0 / cm.time(Batch((ScheduledSeq("r", 1, ctx, 5),)))


def _busbw_gbps(hw: str, nbytes: float = 8e9, p: int = 8, algorithm: str = "ring") -> float:
    spec = load_spec(hw)
    link = spec.links.scale_up
    assert link is not None
    alpha = link.latency_s + spec.efficiency.collective_overhead_us * 1e-6
    t = collective_time("all_reduce", nbytes, p, alpha, link.bandwidth_bytes_per_s * spec.efficiency.network, algorithm)
    return nbytes / t * bus_bandwidth_factor("all_reduce", p) / 1e9


def _offline_output_tokens_per_s(model: str, hw: str, tp: int, isl: int, osl: int, num_requests: int,
                                  dtype: str = "fp8", pp: int = 1, precision: str | None = None) -> float:
    """trtllm-bench's throughput scenario through the serving simulator: every request queued at t=0,
    continuous batching (max 2048 seqs, 8192 batched tokens), KV capacity from the memory plan.

    With pp > 1: pp micro-batches per step on the `async` schedule, TensorRT-LLM's PyTorch PP executor loop
    (`_executor_loop_pp`: a new micro-batch enters stage 1 every iteration, pp batches in flight)."""
    n = num_requests
    wl = Workload(np.zeros(n), np.full(n, isl, dtype=np.int64), np.full(n, osl, dtype=np.int64))
    cfg = ServeConfig(tp=tp, pp=pp, max_num_seqs=2048, max_num_batched_tokens=8192, pipeline_schedule="async")
    m = load_model(model, precision=precision) if precision else load_model(model, weight_dtype=dtype, kv_dtype=dtype)
    result, _ = run_serve(m, load_spec(hw), wl, cfg)
    return float(result["throughput"]["output_tokens_per_s"])


def _closed_loop_itl_ms(model: str, hw: str, tp: int, isl: int, osl: int, concurrency: int, dtype: str = "fp8",
                        requests_per_client: int = 8) -> float:
    """A closed-loop load of `concurrency` clients (AIPerf / LLMPerf --concurrency) sending equal requests: the
    same schedule as every request queued at t=0 with at most `concurrency` running (a new one is admitted
    when one finishes). Returns the mean inter-token time (TPOT, first token excluded), which queueing before
    admission does not touch."""
    n = max(requests_per_client * concurrency, 16)
    wl = Workload(np.zeros(n), np.full(n, isl, dtype=np.int64), np.full(n, osl, dtype=np.int64))
    result, _ = run_serve(load_model(model, weight_dtype=dtype, kv_dtype=dtype), load_spec(hw), wl,
                          ServeConfig(tp=tp, max_num_seqs=concurrency))
    return float(result["tpot_s"]["mean"]) * 1e3


def _single_stream_p50_ms(model: str, hw: str, tp: int, isl: int, osl: int, metric: str,
                          precision: str = "bf16") -> float:
    """One request at a time into an idle replica (1 concurrent client, max_num_seqs 1, the whole prompt
    in one prefill step as Neuron's context encoding runs it): the p50 TTFT or TPOT of that request."""
    wl = Workload(np.zeros(1), np.array([isl], dtype=np.int64), np.array([osl], dtype=np.int64))
    result, _ = run_serve(load_model(model, precision=precision), load_spec(hw), wl,
                          ServeConfig(tp=tp, max_num_seqs=1, max_num_batched_tokens=max(8192, isl)))
    return float(result[f"{metric}_s"]["p50"]) * 1e3


def _ttft_ms(model: str, hw: str, tp: int, isl: int, dtype: str) -> float:
    """One request of `isl` prompt tokens into an idle replica: its TTFT from the serving simulator."""
    wl = Workload(np.zeros(1), np.array([isl], dtype=np.int64), np.array([1], dtype=np.int64))
    result, _ = run_serve(load_model(model, weight_dtype=dtype, kv_dtype=dtype), load_spec(hw), wl,
                          ServeConfig(tp=tp))
    return float(result["ttft_s"]["p50"]) * 1e3


def _static_batch_tokens_per_s(model: str, hw: str, tp: int, isl: int, osl: int, batch: int) -> float:
    """A fixed batch of `batch` equal requests queued at t=0 (max_num_seqs = batch): output tokens / makespan."""
    wl = Workload(np.zeros(batch), np.full(batch, isl, dtype=np.int64), np.full(batch, osl, dtype=np.int64))
    cfg = ServeConfig(tp=tp, max_num_seqs=batch, max_num_batched_tokens=max(8192, isl))
    result, _ = run_serve(load_model(model, precision="fp8"), load_spec(hw), wl, cfg)
    return float(result["throughput"]["output_tokens_per_s"])


def _gaudi(model: str, hw: str, tp: int, isl: int, osl: int, batch: int) -> Callable[[], float]:
    return lambda: _static_batch_tokens_per_s(model, hw, tp, isl, osl, batch)


def _tt(model: str, hw: str, tp: int) -> Callable[[], float]:
    return lambda: _decode_tokens_per_s(model, hw, tp, ctx=256, precision="tt-performance")


def _trt(model: str, hw: str, tp: int, isl: int, osl: int, n: int) -> Callable[[], float]:
    return lambda: _offline_output_tokens_per_s(model, hw, tp, isl, osl, n)


def _trt_pp(model: str, pp: int, isl: int, osl: int, n: int) -> Callable[[], float]:
    return lambda: _offline_output_tokens_per_s(model, "rtx-pro-6000", 1, isl, osl, n, pp=pp, precision="nvfp4")


def _nim(c: int) -> Callable[[], float]:
    return lambda: _closed_loop_itl_ms("llama-3.1-70b", "h100-sxm", 2, 5000, 500, c)


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
    # ---- issue 17: other vendors --------------------------------------------------------------------------
    Row("Llama-3.1-8B tt-performance decode, Wormhole n150, batch 1", "decode", "tok/s/u", 28.3, TT_PERF,
        _tt("llama-3.1-8b", "wormhole-n150", 1)),
    Row("Llama-3.1-8B tt-performance decode, Wormhole n300 (2 chips, TP2 on-card Ethernet), batch 1", "decode",
        "tok/s/u", 44.2, TT_PERF, _tt("llama-3.1-8b", "wormhole-n300", 2)),
    Row("Llama-3.1-8B tt-performance decode, T3K (8 chips, TP8 over Ethernet), batch 1", "decode", "tok/s/u", 64.3,
        TT_PERF, _tt("llama-3.1-8b", "t3k", 8)),
    Row("Llama-3.1-8B tt-performance decode, Blackhole p150, batch 1", "decode", "tok/s/u", 33.6, TT_PERF,
        _tt("llama-3.1-8b", "blackhole-p150", 1)),
    Row("Llama-3.1-70B tt-performance decode, T3K, TP8, batch 1", "decode", "tok/s/u", 16.6, TT_PERF,
        _tt("llama-3.1-70b", "t3k", 8)),
    Row("Llama-3.1-70B tt-performance decode, Galaxy (32 chips; tt-metal uses 2D TP, modeled as a TP32 ring), batch 1",
        "decode", "tok/s/u", 12.7, TT_PERF, _tt("llama-3.1-70b", "galaxy-wormhole", 32)),
    Row("Llama-3.1-8B fp8, Gaudi 2, 1 card, batch 289, 128 in / 2048 out", "throughput", "out tok/s", 11138, INTEL_G2,
        _gaudi("llama-3.1-8b", "gaudi2", 1, 128, 2048, 289)),
    Row("Llama-3.1-8B fp8, Gaudi 2, 1 card, batch 155, 2048 in / 2048 out", "throughput", "out tok/s", 5511, INTEL_G2,
        _gaudi("llama-3.1-8b", "gaudi2", 1, 2048, 2048, 155)),
    Row("Llama-2-70B fp8, Gaudi 2, 2 cards (TP2), batch 78, 2048 in / 2048 out", "throughput", "out tok/s", 1438,
        INTEL_G2, _gaudi("llama-2-70b", "gaudi2-hls", 2, 2048, 2048, 78)),
    Row("Llama-3.1-8B fp8, Gaudi 3, 1 card, batch 768, 128 in / 2048 out", "throughput", "out tok/s", 18830, INTEL_G3,
        _gaudi("llama-3.1-8b", "gaudi3", 1, 128, 2048, 768)),
    Row("Llama-3.1-8B fp8, Gaudi 3, 1 card, batch 364, 2048 in / 2048 out", "throughput", "out tok/s", 7405, INTEL_G3,
        _gaudi("llama-3.1-8b", "gaudi3", 1, 2048, 2048, 364)),
    Row("Llama-3.1-70B fp8, Gaudi 3, 2 cards (TP2), batch 175, 2048 in / 2048 out", "throughput", "out tok/s", 2588,
        INTEL_G3, _gaudi("llama-3.1-70b", "gaudi3-hls", 2, 2048, 2048, 175)),
    Row("Llama-3.1-70B fp8, Gaudi 3, 8 cards (TP8), batch 600, 128 in / 2048 out", "throughput", "out tok/s", 15711,
        INTEL_G3, _gaudi("llama-3.1-70b", "gaudi3-hls", 8, 128, 2048, 600)),
    Row("Llama-3.1-405B fp8, 8x MI300X (TP8), batch 1, 128 in / 128 out", "prefill+decode", "out tok/s", 36, OCI_MI300X,
        lambda: 128 / _request_latency_s("llama-3.1-405b", "mi300x-x8", 8, 1, 128, 128, "fp8")),
    Row("Llama-3.1-405B fp8, 8x MI300X (TP8), batch 32, 128 in / 128 out", "prefill+decode", "out tok/s", 798,
        OCI_MI300X, lambda: 32 * 128 / _request_latency_s("llama-3.1-405b", "mi300x-x8", 8, 32, 128, 128, "fp8")),
    Row("all_reduce busbw, 8xH100 NVLink, ring, large messages", "collective", "GB/s", 370.0,
        "NVIDIA/nccl-tests issue #212 (NCCL maintainer: ~370 GB/s effective NVLink busbw with NCCL_ALGO=RING)",
        lambda: _busbw_gbps("h100-sxm")),
    Row("all_reduce busbw, 8xA100-80GB NVLink, 1 GB", "collective", "GB/s", 200.0,
        "NVIDIA/nccl-tests issue #149 (8xA100-SXM4-80GB, HPE Apollo 6500: busbw ~200 GB/s)",
        lambda: _busbw_gbps("a100-80gb", 1e9)),
    Row("all_reduce busbw, 8xH200 NVLink (NCCL default: NVLS), 4 GB", "collective", "GB/s", 475.0,
        "NVIDIA/nccl-tests issue #272 (8xH200, NCCL 2.20.3: peak busbw 475 GB/s)",
        lambda: _busbw_gbps("h200", 4e9, algorithm="nvls")),
    # ---- issue 14 item 9: pipeline parallelism (TensorRT-LLM, RTX PRO 6000 over PCIe, no NVLink) ---------------
    *[Row(f"{name} nvfp4, RTX PRO 6000, TP1 PP{pp}{' (1 GPU)' if pp == 1 else ''}, {n} req {isl} in / {osl} out, "
          "all queued at t=0", "throughput" if pp == 1 else "pipeline", "out tok/s", measured, TRTLLM_PP,
          _trt_pp(model, pp, isl, osl, n))
      for name, model, pp, isl, osl, n, measured in (
          ("Llama-3.3-70B", "llama-3.1-70b", 1, 1000, 1000, 3000, 1787),
          ("Llama-3.3-70B", "llama-3.1-70b", 2, 1000, 1000, 3000, 3707),
          ("Llama-3.3-70B", "llama-3.1-70b", 4, 1000, 1000, 3000, 5961),
          ("Llama-3.3-70B", "llama-3.1-70b", 8, 1000, 1000, 3000, 8166),
          ("Llama-3.3-70B", "llama-3.1-70b", 1, 2048, 128, 3000, 393),
          ("Llama-3.3-70B", "llama-3.1-70b", 2, 2048, 128, 3000, 813),
          ("Llama-3.3-70B", "llama-3.1-70b", 4, 2048, 128, 3000, 1511),
          ("Llama-3.3-70B", "llama-3.1-70b", 8, 2048, 128, 3000, 2495),
          ("Llama-3.1-405B", "llama-3.1-405b", 8, 128, 128, 30000, 4452),
          ("Llama-3.1-405B", "llama-3.1-405b", 8, 1000, 1000, 3000, 2369),
          ("Llama-3.1-405B", "llama-3.1-405b", 8, 2048, 128, 3000, 579))],
    # ---- issue 14 item 9: latency under load (closed loop at a fixed concurrency) ------------------------------
    *[Row(f"Llama-3.3-70B fp8, 2x H100 (TP2), 5000 in / 500 out, concurrency {c}: ITL", "latency-under-load",
          "ms", itl, NIM_70B, _nim(c))
      for c, itl in [(1, 18.58), (5, 21.83), (25, 38.75), (50, 59.73), (100, 92.91), (150, 92.86), (200, 93.06),
                     (250, 93.2)]],
    # ---- issue 14 item 9: Trainium2 (p50 latency, one request at a time) ---------------------------------------
    *[Row(f"{name} bf16, trn2.48xlarge (16 Trainium2, TP16), 10000 in / {out} out, concurrency 1: "
          f"{'TTFT' if m == 'ttft' else 'ITL'} p50", "prefill" if m == "ttft" else "decode", "ms", ms, source,
          (lambda model=model, osl=osl, m=m: _single_stream_p50_ms(model, "trn2-48xl", 16, 10000, osl, m)))
      for name, model, out, osl, source, ttft, itl in [  # osl: the tokens the simulated request generates
          ("Llama-3.3-70B", "llama-3.1-70b", 1500, 1501, NEURON_70B, 575.7, 19.83),
          ("Llama-3.1-405B", "llama-3.1-405b", 1785, 1785, NEURON_405B, 2442.0, 37.93)]
      for m, ms in (("ttft", ttft), ("tpot", itl))],
    # ---- Trainium (first generation): AWS's published latency table, batch 1, p50 ---------------------------------
    *[Row(f"Llama-3-70B bf16, trn1.32xlarge (16 Trainium, TP16), batch 1, {isl} in / {osl} out: {m.upper()} p50",
          "prefill" if m == "ttft" else "decode", "ms", ms, NEURON_TRN1,
          (lambda isl=isl, osl=osl, m=m: _single_stream_p50_ms("llama-3.1-70b", "trn1-32xl", 16, isl, osl, m)))
      for isl, osl, ttft, tpot in [(2048, 2048, 547.0, 26.2), (128, 1024, 53.2, 24.48), (128, 128, 52.53, 26.48)]
      for m, ms in (("ttft", ttft), ("tpot", tpot))],
]


VENDOR_OF = {"tt-metal": "Tenstorrent", "Gaudi 2": "Intel", "Gaudi 3": "Intel", "MI300X": "AMD", "aws-neuron": "AWS"}


def _vendor(row: Row) -> str:
    for key, vendor in VENDOR_OF.items():
        if key in row.source:
            return vendor
    return "NVIDIA"


def run_validation() -> list[dict[str, Any]]:
    out = []
    for r in ROWS:
        pred = r.predict()
        out.append({"what": r.what, "kind": r.kind, "unit": r.unit, "measured": r.measured, "predicted": pred,
                    "error_pct": (pred - r.measured) / r.measured * 100, "source": r.source, "vendor": _vendor(r)})
    return out


def to_markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| # | workload | kind | measured | predicted | error | source |", "|---|---|---|---|---|---|---|"]
    for i, r in enumerate(rows, 1):
        lines.append(f"| {i} | {r['what']} | {r['kind']} | {r['measured']:.4g} {r['unit']} | "
                     f"{r['predicted']:.4g} {r['unit']} | {r['error_pct']:+.1f}% | {r['source']} |")
    errs = sorted(abs(r["error_pct"]) for r in rows)
    lines.append("")
    lines.append(f"median |error| {errs[len(errs) // 2]:.1f}%, max |error| {errs[-1]:.1f}% over {len(rows)} rows")
    for key, title in (("vendor", "vendor"), ("kind", "category")):
        lines += ["", f"| {title} | rows | median abs error | max abs error |", "|---|---|---|---|"]
        for name, (n, median, worst) in error_summary(rows, key).items():
            lines.append(f"| {name} | {n} | {median:.1f}% | {worst:.1f}% |")
    return "\n".join(lines)


def error_summary(rows: list[dict[str, Any]], key: str) -> dict[str, tuple[int, float, float]]:
    """Rows grouped by `key` (vendor | kind): name -> (rows, median |error| %, max |error| %), sorted by name.
    The median of an even count is the upper of the two middle values, as in the overall line."""
    groups: dict[str, list[float]] = {}
    for r in rows:
        groups.setdefault(str(r.get(key, "NVIDIA")), []).append(abs(r["error_pct"]))
    return {name: (len(e), sorted(e)[len(e) // 2], max(e)) for name, e in sorted(groups.items())}
