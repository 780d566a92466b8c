"""Decode attention over fp32, fp16 and bf16 K/V pools (`--kv-cache-dtype`): firstlight::paged_decode_attention
for 30 layers of SmolLM2-135M's heads (9 query / 3 KV heads of 64), every row's keys in random blocks of 16, each
layer's pools its own (cold, as in a decode step), next to the copy-bandwidth bound of the bytes it reads.

    PYTHONPATH=. .venv/bin/python benchmarks/kv_dtype_attention.py --threads 2 --rounds 9

Rounds alternate between the three caches; medians. Bound: the K/V bytes / the memory bandwidth measured in the same
run (a large tensor copy, bytes read + written per second).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _common import memory_bandwidth_gbs

H, HKV, D, LAYERS, BS = 9, 3, 64, 30, 16
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def pools_and_slots(batch: int, keys: int, dtype: torch.dtype) -> tuple[list, torch.Tensor, torch.Tensor]:
    nb = -(-keys // BS)
    nblocks = batch * nb + 8
    pools = [(torch.randn(nblocks * BS, HKV, D).to(dtype), torch.randn(nblocks * BS, HKV, D).to(dtype))
             for _ in range(LAYERS)]
    perm = torch.randperm(nblocks)[: batch * nb].view(batch, nb)
    slots = (perm[:, :, None] * BS + torch.arange(BS)).view(batch, -1)[:, :keys].contiguous()
    return pools, slots, torch.randn(batch, H, D)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--shapes", default="32x160,16x1024,1x4096", help="rows x keys per row, comma-separated")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import firstlight.kernels as kernels

    if kernels.load_kernel() is None:
        raise SystemExit("firstlight's kernel extension is not in use here")
    op = torch.ops.firstlight.paged_decode_attention
    bw = memory_bandwidth_gbs()
    print(f"{args.threads} threads, memory bandwidth {bw:.1f} GB/s; 30 layers, 9 / 3 heads of 64; medians of "
          f"{args.rounds} alternating rounds")
    print(f"{'rows x keys':>12} {'cache':>5} {'ms':>8} {'MB':>6} {'GB/s':>6} {'bound ms':>9} {'% of bound':>10} "
          f"{'vs fp32':>8}")
    for shape in args.shapes.split(","):
        batch, keys = (int(x) for x in shape.split("x"))
        cases = {name: pools_and_slots(batch, keys, dt) for name, dt in DTYPES.items()}
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.rounds):
            for name, (pools, slots, q) in cases.items():
                t0 = time.perf_counter()
                for k, v in pools:
                    op(q, k, v, slots, None, D**-0.5)
                times[name].append(time.perf_counter() - t0)
        base = statistics.median(times["fp32"])
        for name, ts in times.items():
            t = statistics.median(ts)
            nbytes = LAYERS * batch * keys * 2 * HKV * D * DTYPES[name].itemsize
            bound = nbytes / (bw * 1e9)
            print(f"{shape:>12} {name:>5} {1e3 * t:8.2f} {nbytes / 1e6:6.0f} {nbytes / t / 1e9:6.1f} "
                  f"{1e3 * bound:9.2f} {100 * bound / t:9.0f}% {base / t:7.2f}x", flush=True)


if __name__ == "__main__":
    main()
