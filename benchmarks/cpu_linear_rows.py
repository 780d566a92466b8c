"""Time one fp32 linear on the CPU against its row count: the evidence for cpu-host's step-model form.

A roofline prices a linear as max(FLOPs / rate, bytes / bandwidth). On this machine's CPU BLAS two
things break that (docs/VALIDATION.md, "This machine's engine"): a one-row product runs as a
matrix-vector kernel that streams the weights about twice as fast as the packed GEMM used from two rows
on, and the GEMM's time is a fixed weight-stream cost plus FMA time per row (their sum, not their max).
Hence cpu-host.yaml's `overlap: additive` and `gemv_memory`. Times are the engine thread's CPU time
(`time.thread_time`), median of `--repeats`, one torch thread (as the recorded engine traces).

    .venv/bin/python benchmarks/cpu_linear_rows.py                       # SmolLM2's LM head, 576 x 49152
    .venv/bin/python benchmarks/cpu_linear_rows.py --shape 576x1536 --rows 1,2,4,8,64
"""

from __future__ import annotations

import argparse
import time

import torch


def time_linear(in_features: int, out_features: int, rows: int, repeats: int) -> float:
    """Median CPU seconds of `F.linear` on a [rows, in] fp32 input and an [out, in] weight."""
    w = torch.randn(out_features, in_features)
    x = torch.randn(rows, in_features)
    for _ in range(2):
        torch.nn.functional.linear(x, w)
    ts = []
    for _ in range(repeats):
        t0 = time.thread_time()
        torch.nn.functional.linear(x, w)
        ts.append(time.thread_time() - t0)
    return sorted(ts)[len(ts) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="576x49152", help="IN x OUT features (default: SmolLM2-135M's LM head)")
    ap.add_argument("--rows", default="1,2,3,4,8,16,32,64,128,256")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    k, n = (int(v) for v in args.shape.lower().split("x"))
    weight_bytes = 4 * k * n
    print(f"fp32 linear {k} x {n} ({weight_bytes / 1e6:.0f} MB of weights), one thread, CPU time")
    print(f"{'rows':>5} {'ms':>9} {'weights GB/s':>13} {'GFLOP/s':>9}")
    for m in (int(r) for r in args.rows.split(",")):
        t = time_linear(k, n, m, args.repeats)
        print(f"{m:>5} {t * 1e3:>9.2f} {weight_bytes / t / 1e9:>13.1f} {2 * m * k * n / t / 1e9:>9.1f}")


if __name__ == "__main__":
    main()
