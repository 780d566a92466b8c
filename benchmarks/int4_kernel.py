"""firstlight's int4 CPU kernel (firstlight::int4_mm; int4_mm_a8 with int8 activations, the w4a8 format, on
int4's row-major layout and, on an AVX-512 VNNI CPU, on the VNNI layout w4a8 packs there) vs torch's
aten._weight_int4pack_mm_for_cpu vs fp32 torch.mm, at SmolLM2-135M's linear shapes, same run, same
threads; then the int8 weight-only kernel (firstlight::int8_mm, fp32 / int8 activations) vs
aten._weight_int8pack_mm (bf16 activations) at the tied LM head's shape and one layer's.

    PYTHONPATH=. .venv/bin/python benchmarks/int4_kernel.py --threads 1
    PYTHONPATH=. .venv/bin/python benchmarks/int4_kernel.py --threads 2 --ms 1,4,8,32,128
    PYTHONPATH=. .venv/bin/python benchmarks/int4_kernel.py --threads 1 --step     # one decode step's int4 matmuls

Each cell: the median of --repeats rounds; a round times every kernel of the row once, one after the
other (each sample loops enough calls to last ~2 ms), so load from other processes hits them alike.
aten gets bfloat16 activations (how Int4WeightOnlyLinear used it on CPU); ours and torch.mm take fp32.
GB/s = int4 weight bytes (N*K/2 codes + the scales/zeros each kernel reads) / time; the bound is the
machine's memory bandwidth (_common.memory_bandwidth_gbs: the better of a 256 MiB tensor copy and our fp32
panel kernel's read of a 256 MiB weight), measured in the same run. "vnni":
int4_mm_a8 on kernels.pack_int4_vnni's tiled layout (vpdpbusd on AVX-512 VNNI, maddubs + madd on AVX2; not
the scalar build), with its GOP/s (2 M N K / time) next to fp32 torch.mm's GFLOP/s (the BLAS's rate is the
fp32 compute bound this machine reaches).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from _common import median_time, memory_bandwidth_gbs

SHAPES = ((576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152))  # (K, N)


def _interleaved(fns: list, repeats: int) -> list[float]:  # noqa: ANN001
    """Seconds per call of each fn: each round times every fn once (loops of ~2 ms), so a burst of load
    from other processes hits all of them alike; the median over rounds per fn."""
    loops = []
    for fn in fns:
        fn()
        calls = max(1, int(2e-3 / max(median_time(fn, 3), 1e-7)))
        loops.append((fn, calls))
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, (fn, calls) in enumerate(loops):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            samples[i].append((time.perf_counter() - t0) / calls)
    return [statistics.median(s) for s in samples]


INT8_SHAPES = ((576, 49152), (576, 1536))  # the tied LM head; one MLP projection


def int8_rows(args: argparse.Namespace, rows: list[dict]) -> None:
    from firstlight import kernels as ik
    from firstlight.quant.int8 import quantize_per_channel_int8

    print(f"\nint8 weight-only {'K->N':>12} {'M':>4} {'f32 us':>8} {'a8 us':>8} {'aten us':>9} {'aten/f32':>8} "
          f"{'aten/a8':>8} {'f32 GB/s':>8} {'a8 GB/s':>8}")
    for k, n in INT8_SHAPES:
        torch.manual_seed(0)
        q, scale = quantize_per_channel_int8(torch.randn(n, k), scale_dtype=torch.bfloat16)
        scale = scale.bfloat16()
        nbytes = q.numel() + 2 * scale.numel()
        for mm in (int(s) for s in args.ms.split(",")):
            x = torch.randn(mm, k)
            xb = x.bfloat16()
            t_f, t_a, t_t = _interleaved([
                lambda x=x, q=q, s=scale: ik.int8_mm(x, q, s, False),
                lambda x=x, q=q, s=scale: ik.int8_mm(x, q, s, True),
                lambda xb=xb, q=q, s=scale: torch.ops.aten._weight_int8pack_mm(xb, q, s)], args.repeats)
            rows.append(dict(kind="int8", k=k, n=n, m=mm, f32_us=t_f * 1e6, a8_us=t_a * 1e6, aten_us=t_t * 1e6))
            print(f"{'':>16} {f'{k}->{n}':>12} {mm:>4} {t_f * 1e6:>8.1f} {t_a * 1e6:>8.1f} {t_t * 1e6:>9.1f} "
                  f"{t_t / t_f:>8.2f} {t_t / t_a:>8.2f} {nbytes / t_f / 1e9:>8.1f} {nbytes / t_a / 1e9:>8.1f}")


LAYER_SHAPES = ((576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536), (1536, 576))  # q k v o g u d


def step_rows(args: argparse.Namespace) -> None:
    """The int4 matmuls of one SmolLM2-135M decode step (30 layers x 7 at M = 1), int4_mm vs int4_mm_a8,
    alternating per round: with 30 distinct layers (53 MB: weights stream from DRAM) and with 2 layers
    reused (cache-resident), to tell bandwidth from instructions."""
    from firstlight import kernels as ik
    from firstlight.quant.int4 import quantize_groupwise_int4

    xs = {576: torch.randn(1, 576), 1536: torch.randn(1, 1536)}
    for distinct in (30, 2):
        torch.manual_seed(0)
        layers = []
        for _ in range(distinct):
            ws = []
            for k, n in LAYER_SHAPES:
                q, scale, zero = quantize_groupwise_int4(torch.randn(n, k) / k**0.5, 32, param_dtype=torch.bfloat16)
                ws.append((k, ik.pack_int4(q, scale, zero, 32)))
            layers.append(ws)
        order = (layers * 30)[:30]

        def step(mm, order=order) -> None:  # noqa: ANN001
            for ws in order:
                for k, (p, d, mins) in ws:
                    mm(xs[k], p, d, mins, 32)
        t_f, t_a = [], []
        for _ in range(args.repeats):
            for fn, out in ((ik.int4_mm, t_f), (ik.int4_mm_a8, t_a)):
                t0 = time.perf_counter()
                step(fn)
                out.append(time.perf_counter() - t0)
        ratio = statistics.median(f / a for f, a in zip(t_f, t_a, strict=True))
        print(f"one step's int4 matmuls, {distinct} distinct layers: float {statistics.median(t_f) * 1e3:.2f} ms, "
              f"int8 activations {statistics.median(t_a) * 1e3:.2f} ms, float / a8 {ratio:.2f} (median of rounds)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ms", default="1,4,8,32,128", help="activation rows M")
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--step", action="store_true", help="only the per-step float vs int8-activation A/B")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("FIRSTLIGHT_CPU_KERNELS", "firstlight")

    from firstlight import kernels as ik
    from firstlight.quant.int4 import quantize_groupwise_int4

    isa = ik.load_kernel()
    if args.step:
        print(f"threads {args.threads}, kernel {isa}, load {os.getloadavg()[0]:.2f}")
        step_rows(args)
        return
    g = args.group_size
    bw = memory_bandwidth_gbs()
    rows = []
    print(f"threads {args.threads}, kernel {isa}, group {g}, memory bandwidth {bw:.1f} GB/s, "
          f"load {os.getloadavg()[0]:.2f}")
    vnni = isa in ik.TILED_ISAS  # w4a8's tiled layout: vpdpbusd (avx512vnni) or maddubs (avx2)
    print(f"{'K->N':>12} {'M':>4} {'ours us':>9} {'a8 us':>8} {'aten us':>9} {'fp32 mm us':>10} {'aten/ours':>9} "
          f"{'ours/a8':>8} {'mm/ours':>8} {'ours GB/s':>9} {'a8 GB/s':>8} {'aten GB/s':>9} {'vnni us':>8} "
          f"{'a8/vnni':>8} {'mm/vnni':>8} {'vnni GOP/s':>10} {'mm GFLOP/s':>10}")
    with torch.inference_mode():
        for k, n in SHAPES:
            torch.manual_seed(0)
            w = torch.randn(n, k) / k**0.5
            q, scale, zero = quantize_groupwise_int4(w, g, param_dtype=torch.bfloat16)
            packed, d, mins = ik.pack_int4(q, scale, zero, g)
            vp, vd, vm = ik.pack_int4_vnni(packed, d, mins) if vnni else (None, None, None)
            apacked = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
            sz = torch.stack([scale, zero], dim=-1).bfloat16()
            wf = w.t().contiguous()  # [K, N] for x @ wf
            ours_bytes = packed.numel() + 8 * d.numel()
            aten_bytes = apacked.numel() * apacked.element_size() + 2 * sz.numel()
            for mm in (int(s) for s in args.ms.split(",")):
                x = torch.randn(mm, k)
                xb = x.bfloat16()
                fns = [lambda x=x, p=packed, d=d, mi=mins: ik.int4_mm(x, p, d, mi, g),
                       lambda x=x, p=packed, d=d, mi=mins: ik.int4_mm_a8(x, p, d, mi, g),
                       lambda xb=xb, p=apacked, sz=sz: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, p, g, sz),
                       lambda x=x, wf=wf: torch.mm(x, wf)]
                if vnni:
                    fns.append(lambda x=x, vp=vp, vd=vd, vm=vm: ik.int4_mm_a8(x, vp, vd, vm, g))
                t_ours, t_a8, t_aten, t_mm, *t_v = _interleaved(fns, args.repeats)
                row = dict(k=k, n=n, m=mm, ours_us=t_ours * 1e6, a8_us=t_a8 * 1e6, aten_us=t_aten * 1e6,
                           mm_us=t_mm * 1e6, ours_gbs=ours_bytes / t_ours / 1e9, a8_gbs=ours_bytes / t_a8 / 1e9,
                           aten_gbs=aten_bytes / t_aten / 1e9, vnni_us=t_v[0] * 1e6 if t_v else None)
                rows.append(row)
                flop = 2 * mm * n * k
                vcols = (f"{t_v[0] * 1e6:>8.1f} {t_a8 / t_v[0]:>8.2f} {t_mm / t_v[0]:>8.2f} {flop / t_v[0] / 1e9:>10.0f}"
                         if t_v else f"{'-':>8} {'-':>8} {'-':>8} {'-':>10}")
                print(f"{f'{k}->{n}':>12} {mm:>4} {row['ours_us']:>9.1f} {row['a8_us']:>8.1f} {row['aten_us']:>9.1f} "
                      f"{row['mm_us']:>10.1f} {t_aten / t_ours:>9.2f} {t_ours / t_a8:>8.2f} {t_mm / t_ours:>8.2f} "
                      f"{row['ours_gbs']:>9.1f} {row['a8_gbs']:>8.1f} {row['aten_gbs']:>9.1f} {vcols} "
                      f"{flop / t_mm / 1e9:>10.0f}")
        int8_rows(args, rows)
    if args.json:
        print(json.dumps(dict(threads=args.threads, isa=isa, copy_gbs=bw, load=os.getloadavg()[0], rows=rows)))


if __name__ == "__main__":
    main()
