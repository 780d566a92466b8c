"""Prefill attention: firstlight::attention (kernels/csrc/paged_attention.cpp, what the engine's prefill chunks run
on fp32 KV on CPU: engine/runner.py PagedKVCache.attend) vs torch's SDPA (its CPU flash kernel, GQA), at the
shapes a prefill step has: SmolLM2-135M's heads (9 query, 3 KV, D = 64) and Gemma 3 270M's (4, 1, D = 256).

    PYTHONPATH=. .venv/bin/python benchmarks/prefill_attention.py --threads 2

Cases: B prompts of S tokens each, causal (a chunk of 16 prompts of 142 tokens is what one 2,048-token step of
the servers benchmark's c = 32 run holds); and a chunk of S queries after L - S earlier keys (chunked prefill of
a long prompt: the model's boolean mask). Per case the median over --repeats rounds, the two alternating inside
a round. FLOPs = 4 x D x H x the visible (query, key) pairs (QK^T and PV, the masked half not counted); bound
= FLOPs at the GEMM rate measured in this run (oneDNN's [1024, 1024] fp32 matmul, hot: the CPU's FMA peak).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F
from _common import median_time

# (label, B, H, Hkv, D, S, L): L > S = queries after earlier keys
CASES = (
    ("SmolLM2, 16 prompts x 142", 16, 9, 3, 64, 142, 142),
    ("SmolLM2, 4 x 512", 4, 9, 3, 64, 512, 512),
    ("SmolLM2, 1 x 2048", 1, 9, 3, 64, 2048, 2048),
    ("SmolLM2, 512 after 1536", 1, 9, 3, 64, 512, 2048),
    ("Gemma 3 270M, 8 x 256", 8, 4, 1, 256, 256, 256),
)


def onednn_peak_gflops() -> float:
    square = torch.randn(1024, 1024)
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return 2 * 1024**3 / median_time(lambda: torch.mm(square, square), 5) / 1e9
    w = torch.ops.mkldnn._reorder_linear_weight(square, None)
    return 2 * 1024**3 / median_time(lambda: torch.ops.mkldnn._linear_pointwise(square, w, None, "none", [], ""), 5) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from firstlight import kernels

    if kernels.load_kernel() is None:
        raise SystemExit("firstlight's kernel extension is not in use here (FIRSTLIGHT_CPU_KERNELS / build)")
    torch.manual_seed(0)
    peak = onednn_peak_gflops()
    print(f"{args.threads} thread(s), kernel build {kernels.load_kernel()}; GEMM {peak:.0f} GFLOP/s; load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs")
    print("| case | SDPA ms | ours ms | SDPA / ours | ours GFLOP/s | bound ms | ours / bound |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for label, b, h, hkv, d, s, length in CASES:
        # views of [B, S, H, D] storage, as the model passes them
        q = torch.randn(b, s, h, d).transpose(1, 2)
        k = torch.randn(b, length, hkv, d).transpose(1, 2)
        v = torch.randn(b, length, hkv, d).transpose(1, 2)
        mask = None
        if length > s:  # the model's mask for queries at positions L - S .. L - 1
            mask = torch.ones(s, length, dtype=torch.bool).tril(length - s).expand(b, 1, s, length)
        pairs = b * (s * (length - s) + s * (s + 1) // 2)
        flops = 4 * d * h * pairs

        def sdpa(q=q, k=k, v=v, mask=mask, scale=d**-0.5, gqa=hkv != h) -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                                  enable_gqa=gqa)

        def ours(q=q, k=k, v=v, mask=mask, scale=d**-0.5) -> torch.Tensor:
            return kernels.attention(q, k, v, mask, mask is None, scale)

        err = (ours() - sdpa()).abs().max().item()
        assert err < 1e-4, f"{label}: max |ours - SDPA| = {err}"
        times: dict[str, list[float]] = {"sdpa": [], "ours": []}
        with torch.inference_mode():
            for _ in range(args.repeats):
                for name, fn in (("sdpa", sdpa), ("ours", ours)):
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
        ref, got = statistics.median(times["sdpa"]), statistics.median(times["ours"])
        bound = flops / peak / 1e9
        print(f"| {label} | {1e3 * ref:.2f} | {1e3 * got:.2f} | {ref / got:.2f}x | {flops / got / 1e9:.0f} | "
              f"{1e3 * bound:.2f} | {got / bound:.1f}x |")


if __name__ == "__main__":
    main()
