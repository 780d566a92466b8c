"""Bench client bias and capacity: the raw asyncio client vs httpx (same run), against the reference server.

Prints, per backend: the client's mean TTFT bias at concurrency 64 (measured minus what the
reference server did, by its own send stamps; goal <= 0.5 ms; aiperf and guidellm measure +1.5 to
+4.7 ms on this kind of test), the total (measured minus injected, which adds the reference
server's own lateness), the per-token ITL bias and the closed-loop streamed requests/s at
concurrency 256 (goal >= 1,000). The client and the reference server each run one event-loop thread
in their own process. Medians of --repeats runs are quoted.

    .venv/bin/python benchmarks/bench_client.py [--repeats 3] [--backends raw,httpx]
"""

from __future__ import annotations

import argparse
import os
import statistics

from firstlight.bench.calibrate import _bias_point, _capacity
from firstlight.bench.reference import ReferenceConfig, reference_server


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backends", default="raw,httpx")
    ap.add_argument("--requests", type=int, default=384)
    a = ap.parse_args()
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}; "
          "1 event-loop thread in the client process, 1 in the server process")
    cfg = ReferenceConfig(first_token_ms=50.0, per_token_ms=10.0, tokens_per_chunk=1)
    for backend in a.backends.split(","):
        ttft, total, itl, cap = [], [], [], []
        for _ in range(a.repeats):
            with reference_server(cfg) as url:
                p = _bias_point(url, cfg, 64, a.requests, 16, backend)
            ttft.append(p["ttft_bias_client_part_mean"])
            total.append(p["ttft_ms_bias_mean"])
            itl.append(p["itl_token_ms_bias_mean"])
            cap.append(_capacity(backend, 256, 2.0, 8)["max_streamed_requests_per_s"])
        print(f"{backend:6s} client TTFT bias @c=64 (median of {a.repeats}): {statistics.median(ttft):+.3f} ms "
              f"(goal <= 0.5 ms; measured - injected {statistics.median(total):+.3f} ms)   "
              f"ITL/token bias: {statistics.median(itl):+.3f} ms   "
              f"capacity @c=256: {statistics.median(cap):.0f} streamed req/s (goal >= 1000)")


if __name__ == "__main__":
    main()
