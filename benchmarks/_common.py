"""Helpers shared by the benchmark scripts (run as `python benchmarks/NAME.py`)."""

from __future__ import annotations

import functools
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


def _copy_gbs(num_bytes: int, repeats: int) -> float:
    """A num_bytes tensor copy's bytes read + written per second (GB/s); its buffers are freed on return."""
    src = torch.empty(num_bytes // 4, dtype=torch.float32).normal_()
    dst = torch.empty_like(src)
    return 2 * num_bytes / median_time(lambda: dst.copy_(src), repeats) / 1e9


@functools.cache
def _panel_read_probe(num_bytes: int) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """(panels of a num_bytes fp32 weight of K = 512, one activation row, N) for f32_mm_packed, made once per
    process (servers.py measures the bandwidth beside every run); None where fp32 does not run on panels."""
    from firstlight import kernels

    if kernels.load_kernel() is None or not kernels.f32_panels():
        return None
    k = 512
    n = num_bytes // 4 // k
    return kernels.f32_pack(torch.randn(n, k)), torch.randn(1, k), n


def memory_bandwidth_gbs(num_bytes: int = 256 << 20, repeats: int = 5) -> float:
    """Achievable memory bandwidth (GB/s): the better of a large tensor copy (bytes read + written per second) and,
    where firstlight's fp32 panel kernel runs (an AVX-512 build), a read of a weight of num_bytes by it at one
    activation row (software-prefetched: on the Zen 5 VM it reads at ~40-50 GB/s where the copy moves ~35, so a
    bound from the copy alone had fp32 single-stream decode running at 105 % of it)."""
    from firstlight import kernels

    best = _copy_gbs(num_bytes, repeats)
    probe = _panel_read_probe(num_bytes)
    if probe is not None:
        panels, x, n = probe
        best = max(best, num_bytes / median_time(lambda: kernels.f32_mm_packed(x, panels, n), repeats) / 1e9)
    return best


def gemm_gflops(m: int, k: int, n: int, dtype: torch.dtype = torch.float32, repeats: int = 5) -> float:
    """Achievable matmul rate at one shape: [m, k] @ [k, n], 2*m*k*n FLOPs per call (GFLOP/s)."""
    a = torch.randn(m, k, dtype=dtype)
    b = torch.randn(k, n, dtype=dtype)
    calls = max(1, int(2e8 // (2 * m * k * n)))  # ~0.2 GFLOP per timed sample, so tiny shapes still time
    def run() -> None:
        for _ in range(calls):
            torch.mm(a, b)
    return 2 * m * k * n * calls / median_time(run, repeats) / 1e9
