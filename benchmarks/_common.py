"""Helpers shared by the benchmark scripts (run as `python benchmarks/NAME.py`)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def median_time(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of `repeats` calls of fn, in seconds."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth_gbs(num_bytes: int = 256 << 20, repeats: int = 5) -> float:
    """Achievable memory bandwidth: a large tensor copy, bytes read + written per second (GB/s)."""
    src = torch.empty(num_bytes // 4, dtype=torch.float32).normal_()
    dst = torch.empty_like(src)
    return 2 * num_bytes / median_time(lambda: dst.copy_(src), repeats) / 1e9


def gemm_gflops(m: int, k: int, n: int, dtype: torch.dtype = torch.float32, repeats: int = 5) -> float:
    """Achievable matmul rate at one shape: [m, k] @ [k, n], 2*m*k*n FLOPs per call (GFLOP/s)."""
    a = torch.randn(m, k, dtype=dtype)
    b = torch.randn(k, n, dtype=dtype)
    calls = max(1, int(2e8 // (2 * m * k * n)))  # ~0.2 GFLOP per timed sample, so tiny shapes still time
    def run() -> None:
        for _ in range(calls):
            torch.mm(a, b)
    return 2 * m * k * n * calls / median_time(run, repeats) / 1e9
