"""fp32 linears: firstlight::f32_mm_packed on weights packed once into panels (kernels/csrc/f32_gemm.cpp, what
F32Linear runs on an AVX-512 build) vs firstlight::f32_mm's tiles on the weights in place vs torch's F.linear (the
BLAS torch ships: MKL here) vs oneDNN's matmul on weights reordered once (torch.ops.mkldnn._linear_pointwise,
what F32Linear runs above `onednn_min_rows()` elsewhere, quant/f32.py) over one decode step's weights of
SmolLM2-135M (30 layers x qkv/o/gate_up/down, then the tied 49152 x 576 head), cold: each weight is used once per
pass, as in a decode step, so it streams from memory.

    PYTHONPATH=. .venv/bin/python benchmarks/f32_gemm.py --threads 2
    PYTHONPATH=. .venv/bin/python benchmarks/f32_gemm.py --threads 1 --ms 1,2,4,8,16,32,64

Per M: the median over --repeats rounds of one pass each (the four alternate inside a round, so load from
other processes hits all). Bound of a pass: max(weight bytes / memory bandwidth, FLOPs / GEMM rate), both
measured in this run: the bandwidth the other benchmarks' (_common.memory_bandwidth_gbs: the better of a tensor
copy and the panels' read at one row; a sum over a tensor, used until 2026-12-03, read slower than the panels
at M = 8), the GEMM rate the better of torch.mm
and oneDNN at [1024, 1024] x [1024, 1024] (hot, near the FMA peak of the ISA each uses: MKL runs AVX2 code
on AMD CPUs, oneDNN the CPU's widest).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from _common import gemm_gflops, median_time, memory_bandwidth_gbs

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (N, K) of one SmolLM2-135M layer
LAYERS, HEAD = 30, (49152, 576)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ms", default="1,2,4,8,16,32,64,128,512")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from firstlight import kernels

    if kernels.load_kernel() is None:
        raise SystemExit("firstlight's kernel extension is not in use here (FIRSTLIGHT_CPU_KERNELS / build)")
    torch.manual_seed(0)
    weights = [torch.randn(n, k) * 0.02 for _ in range(LAYERS) for n, k in SHAPES] + [torch.randn(*HEAD) * 0.02]
    wbytes = sum(w.numel() * 4 for w in weights)
    onednn = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    reordered = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights] if onednn else []
    panels = [(kernels.f32_pack(w), w.shape[0]) for w in weights]

    def onednn_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

    square = torch.randn(1024, 1024)
    square_r = torch.ops.mkldnn._reorder_linear_weight(square, None) if onednn else None
    dnn_peak = 2 * 1024 ** 3 / median_time(lambda: onednn_linear(square, square_r), 5) / 1e9 if onednn else 0.0
    bw, peak = memory_bandwidth_gbs(), max(gemm_gflops(1024, 1024, 1024), dnn_peak)
    print(f"{args.threads} thread(s); one pass = {len(weights)} linears, {wbytes / 1e6:.0f} MB fp32 weights; "
          f"memory bandwidth {bw:.1f} GB/s, GEMM {peak:.0f} GFLOP/s; load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs")
    print(f"{'M':>4} | {'torch F.linear ms':>17} | {'tiles ms':>8} | {'oneDNN ms':>9} | {'panels ms':>9} | "
          f"{'bound ms':>8} | panels vs oneDNN | panels GFLOP/s | panels GB/s")
    for m in (int(s) for s in args.ms.split(",")):
        xs = [torch.randn(m, w.shape[1]) for w in weights]
        flops = sum(2 * m * w.numel() for w in weights)
        fns = {"torch": (lambda x, w: torch.nn.functional.linear(x, w), weights), "tiles": (kernels.f32_mm, weights),
               "panels": (lambda x, pn: kernels.f32_mm_packed(x, *pn), panels)}
        if onednn:
            fns["onednn"] = (onednn_linear, reordered)
        times: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(args.repeats):
            for name, (fn, ws) in fns.items():
                t0 = time.perf_counter()
                for x, w in zip(xs, ws, strict=True):
                    fn(x, w)
                times[name].append(time.perf_counter() - t0)
        ref, tiles, pan = (statistics.median(times[name]) for name in ("torch", "tiles", "panels"))
        dnn = statistics.median(times["onednn"]) if onednn else float("nan")
        bound = max(wbytes / bw / 1e9, flops / peak / 1e9)
        print(f"{m:>4} | {1e3 * ref:>17.1f} | {1e3 * tiles:>8.1f} | {1e3 * dnn:>9.1f} | {1e3 * pan:>9.1f} | "
              f"{1e3 * bound:>8.1f} | {dnn / pan:>15.2f}x | {flops / pan / 1e9:>14.1f} | {wbytes / pan / 1e9:>11.1f}")

if __name__ == "__main__":
    main()
