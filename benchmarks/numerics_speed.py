"""Cost of the emulated numerics (firstlight.numerics) against plain fp32 torch, same run, one thread.

    .venv/bin/python benchmarks/numerics_speed.py --tokens 256 [--repeats 15] [--json out.json]

Shapes are SmolLM2-135M's: activations x [T, 576] (random normal), the MLP up projection W [576, 1536]
(layer 0's, from the checkpoint when it is in the cache). Every
figure is the median over --repeats calls of the thread's CPU time (time.thread_time: on a shared,
loaded machine wall time mostly measures other processes) and its ratio to the fp32 baseline it
replaces, measured in the same run:

- quantize(x, fmt)                       vs  x @ W in fp32 (the matmul it feeds)
- matmul(x, W, numerics)                 vs  x @ W in fp32 (weights quantized and fidelity-split once
                                             with prepare_weight, as a target caches them; activations
                                             quantized and split per call)
- approx(op, impl)(h), h [T, 1536]       vs  torch's exact op on h
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch

from firstlight.numerics import MatmulNumerics, approx, matmul, quantize
from firstlight.numerics.arithmetic import prepare_weight
from firstlight.numerics.transcendentals import APPROX

FORMATS = ["bf16", "fp16", "fp8_e4m3", "bfp8_b", "bfp4_b", "mxfp8_e4m3", "mxfp4", "mxint8", "nvfp4"]
MATMULS: dict[str, MatmulNumerics] = {
    "bf16 x, bfp8_b W, exact multiplier": MatmulNumerics(a_format="bf16"),
    "bfp8_b, LoFi": MatmulNumerics(a_format="bf16", fidelity="lofi"),
    "bfp8_b, HiFi2": MatmulNumerics(a_format="bf16", fidelity="hifi2"),
    "bfp8_b, HiFi3": MatmulNumerics(a_format="bf16", fidelity="hifi3"),
    "bfp8_b, HiFi4": MatmulNumerics(a_format="bf16", fidelity="hifi4"),
    "fp8 e4m3 block:128, fp22 acc, promote 128 (Hopper)": MatmulNumerics(
        accumulator="fp22", rounding="truncate", mma_k=32, promotion_interval=128
    ),
    "bf16 Dst acc, LoFi, mma_k 32 (TT, fp32_dest_acc_en=0)": MatmulNumerics(
        a_format="bf16", fidelity="lofi", accumulator="bf16", mma_k=32
    ),
    "bf16 Dst acc, HiFi2, mma_k 16": MatmulNumerics(a_format="bf16", fidelity="hifi2", accumulator="bf16", mma_k=16),
}
WEIGHT_FORMAT = {"fp8 e4m3 block:128, fp22 acc, promote 128 (Hopper)": ("fp8_e4m3", "block:128")}


def cpu_median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--weights", default=os.path.expanduser("~/.cache/firstlight/models/smollm2-135m/model.safetensors"),
        help="take W from this checkpoint's model.layers.0.mlp.up_proj.weight (random if absent)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.tokens, 576, generator=g)
    w = torch.randn(576, 1536, generator=g) * 0.05
    if os.path.exists(args.weights):
        from safetensors import safe_open

        with safe_open(args.weights, "pt") as f:
            w = f.get_tensor("model.layers.0.mlp.up_proj.weight").float().t().contiguous()  # [576, 1536]
    h = torch.randn(args.tokens, 1536, generator=g) * 3
    rows: list[dict] = []
    base_mm = cpu_median_ms(lambda: x @ w, args.repeats)
    fp32_err = (((x @ w).double() - x.double() @ w.double()).norm() / (x.double() @ w.double()).norm()).item()
    print(f"load average {os.getloadavg()[0]:.1f}; fp32 x[{args.tokens},576] @ W[576,1536]: {base_mm:.2f} ms CPU, "
          f"rel. error {fp32_err:.1e}")

    print("\nquantize(x, fmt)                      ms   / fp32 matmul")
    for fmt in FORMATS:
        ms = cpu_median_ms(lambda fmt=fmt: quantize(x, fmt), args.repeats)
        rows.append({"what": f"quantize {fmt}", "ms": ms, "baseline_ms": base_mm})
        print(f"  {fmt:34s} {ms:7.2f}  {ms / base_mm:5.2f}x")

    exact = x.double() @ w.double()
    print("\nmatmul(x, W, numerics)                ms   / fp32 matmul   rel. error (Frobenius, vs fp64)")
    for name, nm in MATMULS.items():
        wfmt, scaling = WEIGHT_FORMAT.get(name, ("bfp8_b", None))
        wq = prepare_weight(quantize(w, wfmt, axis=0, scaling=scaling), nm)  # once, as a target caches it
        a_fmt = nm.a_format
        if name in WEIGHT_FORMAT:  # activations: 1x128 blocks with fp32 scales (DeepSeek-V3)
            def run(nm=nm, wq=wq) -> torch.Tensor:
                return matmul(quantize(x, "fp8_e4m3", scaling="block:128"), wq, nm)
        else:
            def run(nm=nm, wq=wq) -> torch.Tensor:
                return matmul(x, wq, nm)
        ms = cpu_median_ms(run, args.repeats)
        err = ((run().double() - exact).norm() / exact.norm()).item()
        rows.append({"what": f"matmul {name}", "ms": ms, "baseline_ms": base_mm, "a_format": a_fmt, "rel_err": err})
        print(f"  {name:52s} {ms:7.2f}  {ms / base_mm:5.2f}x  {err:.2e}")

    print("\napprox(op, impl)(h[T,1536])            ms   / torch exact")
    for op, impls in APPROX.items():
        hin = h.abs() + 0.1 if op in ("reciprocal", "rsqrt", "sqrt", "log") else h
        base = cpu_median_ms(lambda op=op, hin=hin: APPROX[op]["exact"](hin), args.repeats)
        for impl in impls:
            if impl == "exact":
                continue
            ms = cpu_median_ms(lambda op=op, impl=impl, hin=hin: approx(op, impl)(hin), args.repeats)
            rows.append({"what": f"{op} {impl}", "ms": ms, "baseline_ms": base})
            print(f"  {op + ' ' + impl:34s} {ms:7.2f}  {ms / base:5.2f}x  (exact {base:.2f} ms)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tokens": args.tokens, "load_average": os.getloadavg()[0], "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
