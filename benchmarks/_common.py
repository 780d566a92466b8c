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
