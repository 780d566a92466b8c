"""Workloads: when requests arrive and how long their prompts and outputs are.

Arrival patterns are registered by name (`poisson`, `gamma`, `trace`); lengths are fixed, uniform
(+-50%) or exponential around a mean, or taken from a trace file (JSONL or CSV rows with
`arrival_s`, `num_prompt_tokens`, `num_output_tokens`).
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from firstlight.errors import FirstlightError


class WorkloadError(FirstlightError):
    """A workload that cannot be generated or read."""


@dataclass(frozen=True)
class Workload:
    arrival_s: np.ndarray  # sorted, float64
    num_prompt_tokens: np.ndarray  # int64, >= 1
    num_output_tokens: np.ndarray  # int64, >= 1
    num_cached_tokens: np.ndarray | None = None  # int64 prompt tokens a prefix cache serves (not recomputed)

    def __len__(self) -> int:
        return len(self.arrival_s)


ArrivalFn = Callable[[int, float, np.random.Generator, float], np.ndarray]
ARRIVALS: dict[str, ArrivalFn] = {}


def register_arrival(name: str) -> Callable[[ArrivalFn], ArrivalFn]:
    def deco(fn: ArrivalFn) -> ArrivalFn:
        ARRIVALS[name] = fn
        return fn

    return deco


@register_arrival("poisson")
def poisson(n: int, rate: float, rng: np.random.Generator, cv: float = 1.0) -> np.ndarray:
    return np.cumsum(rng.exponential(1.0 / rate, n))


@register_arrival("gamma")
def gamma(n: int, rate: float, rng: np.random.Generator, cv: float = 1.0) -> np.ndarray:
    """Gamma inter-arrivals with mean 1/rate and coefficient of variation `cv` (cv > 1: burstier)."""
    shape = 1.0 / (cv * cv)
    return np.cumsum(rng.gamma(shape, 1.0 / (rate * shape), n))


@register_arrival("uniform")
def uniform(n: int, rate: float, rng: np.random.Generator, cv: float = 1.0) -> np.ndarray:
    """Deterministic arrivals every 1/rate seconds."""
    return np.arange(1, n + 1, dtype=np.float64) / rate


def _lengths(n: int, mean: int, dist: str, rng: np.random.Generator, what: str) -> np.ndarray:
    if mean < 1:
        raise WorkloadError(f"{what} length must be >= 1, got {mean}")
    if dist == "fixed":
        return np.full(n, mean, dtype=np.int64)
    if dist == "uniform":
        return rng.integers(max(1, mean // 2), mean + mean // 2 + 1, n).astype(np.int64)
    if dist == "exponential":
        return np.maximum(1, np.rint(rng.exponential(mean, n))).astype(np.int64)
    raise WorkloadError(f"unknown length distribution {dist!r}: expected fixed, uniform or exponential")


def make_workload(num_requests: int, rate: float, prompt_len: int, output_len: int, arrival: str = "poisson",
                  cv: float = 1.0, len_dist: str = "fixed", seed: int = 0) -> Workload:
    if num_requests < 1:
        raise WorkloadError(f"num_requests must be >= 1, got {num_requests}")
    if not rate > 0:
        raise WorkloadError(f"request rate must be > 0 requests/s, got {rate}")
    if arrival not in ARRIVALS:
        raise WorkloadError(f"unknown arrival pattern {arrival!r}: expected one of {sorted(ARRIVALS)} or a trace file")
    rng = np.random.default_rng(seed)
    arrivals = ARRIVALS[arrival](num_requests, rate, rng, cv)
    return Workload(arrivals, _lengths(num_requests, prompt_len, len_dist, rng, "prompt"),
                    _lengths(num_requests, output_len, len_dist, rng, "output"))


def load_trace(path: str | Path) -> Workload:
    """Rows with arrival_s, num_prompt_tokens, num_output_tokens (JSONL or CSV)."""
    path = Path(path)
    if not path.is_file():
        raise WorkloadError(f"workload trace {path} does not exist")
    rows: list[dict[str, str]] = []
    what = (f"--trace {path}: neither a firstlight engine trace nor a workload (JSONL or CSV rows with arrival_s, "
            "num_prompt_tokens, num_output_tokens)")
    try:
        if path.suffix == ".csv":
            with open(path) as f:
                rows = list(csv.DictReader(f))
        else:
            rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (json.JSONDecodeError, UnicodeDecodeError, csv.Error) as e:
        raise WorkloadError(f"{what}: {e}") from None
    if not all(isinstance(r, dict) for r in rows):
        raise WorkloadError(f"{what}: a row is not a JSON object")
    try:
        arr = np.array([float(r["arrival_s"]) for r in rows])
        p = np.array([int(r["num_prompt_tokens"]) for r in rows], dtype=np.int64)
        o = np.array([int(r["num_output_tokens"]) for r in rows], dtype=np.int64)
    except (KeyError, ValueError) as e:
        raise WorkloadError(f"{what}: a row lacks or mangles {e}") from None
    if len(arr) == 0 or (p < 1).any() or (o < 1).any():
        raise WorkloadError(f"workload trace {path}: needs >= 1 row and token counts >= 1")
    order = np.argsort(arr, kind="stable")
    return Workload(arr[order], p[order], o[order])
