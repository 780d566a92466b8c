"""Simulator speed: 100,000 requests of a 70B-class model on 8 GPUs (one TP=8 replica), one core.

Prints the simulated requests per wall-second next to the bound from the issue (>= 10,000 req/s,
i.e. 100k requests in <= 10 s). The simulator is pure Python (no threads); run it pinned to one core:

    taskset -c 0 .venv/bin/python benchmarks/sim_speed.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from firstlight.core.hardware import load_spec
from firstlight.sim.model import load_model
from firstlight.sim.serve import ServeConfig, run_serve
from firstlight.sim.workload import make_workload


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-requests", type=int, default=100_000)
    ap.add_argument("--rate", type=float, default=25.0)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    model, hw = load_model("llama-3.1-70b"), load_spec("h100")
    wl = make_workload(args.num_requests, args.rate, 512, 128, len_dist="uniform", seed=0)
    walls = []
    result = {}
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        result, _ = run_serve(model, hw, wl, ServeConfig(tp=8))
        walls.append(time.perf_counter() - t0)
    med = statistics.median(walls)
    print(f"model llama-3.1-70b on 8x h100 (tp=8), {args.num_requests} requests at {args.rate} req/s, "
          "prompt 512 / output 128 (uniform +-50%)")
    print(f"simulated steps {result['num_steps'][0]}, events {result['sim']['num_events']}, "
          f"simulated time {result['makespan_s']:.0f} s")
    print(f"wall time median of {args.repeats}: {med:.2f} s  (bound: <= 10 s)  runs: "
          + ", ".join(f"{w:.2f}" for w in walls))
    print(f"requests simulated per wall-second: {args.num_requests / med:,.0f}  (bound: >= {args.num_requests / 10:,.0f})")


if __name__ == "__main__":
    main()
