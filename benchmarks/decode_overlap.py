"""Would a decode step gain from attention and GEMMs at the same time on different cores (NanoFlow's
nano-batches)? SmolLM2-135M's shapes, 30 layers of a batch-32 fp32 decode step (the four linears on oneDNN,
as `firstlight serve` runs them, and paged attention over 158 keys per row in random blocks):

  today        per layer, the linears at M = 32 on both threads, then attention on both threads
  halves       the same work as two half batches one after the other (what splitting costs the GEMMs alone)
  overlapped   per layer, half A's attention on one thread while half B's linears run on the other, then
               the other way round (Python threads; torch ops release the GIL)

    PYTHONPATH=. .venv/bin/python benchmarks/decode_overlap.py --rounds 7

Needs two threads; medians of alternating rounds. The step's glue, head and sampler are left out.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

E, INTER, H, HKV, D, L, B, LAYERS, BS = 576, 1536, 9, 3, 64, 158, 32, 30, 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(2)

    import firstlight.kernels as kernels
    from firstlight.quant.f32 import use_f32_kernel

    kernels.load_kernel()
    lin = []
    for _ in range(LAYERS):
        mods = torch.nn.ModuleList([torch.nn.Linear(E, (H + 2 * HKV) * D, bias=False), torch.nn.Linear(H * D, E, bias=False),
                                    torch.nn.Linear(E, 2 * INTER, bias=False), torch.nn.Linear(INTER, E, bias=False)])
        use_f32_kernel(mods.requires_grad_(False))
        lin.append(mods)
    nb = (L + BS - 1) // BS
    nblocks = B * nb + 8
    pools = [(torch.randn(nblocks * BS, HKV, D), torch.randn(nblocks * BS, HKV, D)) for _ in range(LAYERS)]
    perm = torch.randperm(nblocks)[: B * nb].view(B, nb)
    slots = (perm[:, :, None] * BS + torch.arange(BS)).view(B, -1)[:, :L].contiguous()
    op = torch.ops.firstlight.paged_decode_attention
    x, xo, xa, q = torch.randn(B, E), torch.randn(B, H * D), torch.randn(B, INTER), torch.randn(B, H, D)
    rows_all, half_a, half_b = slice(0, B), slice(0, B // 2), slice(B // 2, B)

    def linears(layer: int, rows: slice) -> None:
        m = lin[layer]
        m[0](x[rows]), m[1](xo[rows]), m[2](x[rows]), m[3](xa[rows])

    def attention(layer: int, rows: slice) -> None:
        k, v = pools[layer]
        op(q[rows].contiguous(), k, v, slots[rows].contiguous(), None, D**-0.5)

    def today() -> None:
        for layer in range(LAYERS):
            linears(layer, rows_all)
            attention(layer, rows_all)

    def halves() -> None:
        for layer in range(LAYERS):
            linears(layer, half_a)
            linears(layer, half_b)
            attention(layer, rows_all)

    def overlapped() -> None:
        torch.set_num_threads(1)
        barrier = threading.Barrier(2)

        def other() -> None:
            torch.set_num_threads(1)
            for layer in range(LAYERS):
                attention(layer, half_a)
                barrier.wait()
                attention(layer, half_b)
                barrier.wait()

        t = threading.Thread(target=other)
        t.start()
        for layer in range(LAYERS):
            linears(layer, half_b)
            barrier.wait()
            linears(layer, half_a)
            barrier.wait()
        t.join()
        torch.set_num_threads(2)

    cases = {"today (M = 32, then attention, 2 threads)": today, "halves one after the other (2 threads)": halves,
             "overlapped (1 thread each)": overlapped}
    times: dict[str, list[float]] = {n: [] for n in cases}
    with torch.inference_mode():
        for layer in range(LAYERS):  # oneDNN's reordered weights made, pools touched
            linears(layer, rows_all)
            linears(layer, half_a)
            attention(layer, rows_all)
        for _ in range(args.rounds):
            for name, fn in cases.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    base = statistics.median(times[next(iter(cases))])
    print(f"30 layers, batch {B}, fp32, 2 threads; medians of {args.rounds} alternating rounds")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"  {name:44s} {m * 1e3:6.1f} ms  ({m / base:.2f}x today)")


if __name__ == "__main__":
    main()
