"""Wall time of a 10,000-point `sim sweep`: local processes vs a local Ray cluster, and that both agree.

Points: 3 specs (h100, h200, mi300x) x TP 1,2,4,8 x 834 request rates (0.5 .. 42.2 req/s) = 10,008;
llama-3.1-8b, 20 requests of 256 in / 32 out per point (small, so the sweep machinery's overhead
shows next to the simulation). Both backends get the same number of CPUs (`--workers`).

    .venv/bin/python benchmarks/sweep_ray.py --workers 2
"""

from __future__ import annotations

import argparse
import time

from firstlight.sim.sweep import SweepSpec, grid, run_sweep


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--num-rates", type=int, default=834)
    ap.add_argument("--num-requests", type=int, default=20)
    args = ap.parse_args()
    rates = [0.5 + 0.05 * i for i in range(args.num_rates)]
    points = grid(["h100", "h200", "mi300x"], [1, 2, 4, 8], [1], rates)
    spec = SweepSpec("llama-3.1-8b", num_requests=args.num_requests, prompt_len=256, output_len=32)
    t0 = time.perf_counter()
    local = run_sweep(points, spec, workers=args.workers)
    t_local = time.perf_counter() - t0
    t0 = time.perf_counter()
    on_ray = run_sweep(points, spec, workers=args.workers, use_ray=True)
    t_ray = time.perf_counter() - t0
    same = [{k: v for k, v in r.items() if k != "sim_wall_s"} for r in local] == \
        [{k: v for k, v in r.items() if k != "sim_wall_s"} for r in on_ray]
    sim_s = sum(r.get("sim_wall_s", 0.0) for r in local)
    print(f"{len(points)} points, {args.workers} workers: local processes {t_local:.1f} s, Ray {t_ray:.1f} s "
          f"(ratio {t_ray / t_local:.2f}); event-loop time inside the points {sim_s:.1f} s; identical rows: {same}")


if __name__ == "__main__":
    main()
