"""MoE expert dispatch vs a dense model with the same active parameters (issue 13).

Two tiny decoders that differ only in their MLPs: a Qwen3-MoE with 64 experts (top-k of them per
token, expert width I) and a dense Qwen3 whose MLP width is k x I, so both have the same active
parameters per token. Each step runs a batch of B tokens (one decode step of B requests) through
`forward_hidden`; the figure is the median step time, same run, same thread count, alternating.
Also timed in isolation: one MoE block vs one dense MLP on the same [B, E] input.

Bound: a decode step at batch B touches every expert that any of its tokens picks. With top-k of X
experts per token (distinct), the expected number of experts hit is X (1 - (1 - k/X)^B), so the MoE
step reads hit/k times the MLP weight bytes of the dense one: in the memory-bound regime the MoE
step cannot be faster than that ratio allows. Printed next to the times.

    .venv/bin/python benchmarks/moe_dispatch.py --threads 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from firstlight.models.config import ModelConfig
from firstlight.models.loader import build_model


def make_models(hidden: int, expert_width: int, num_experts: int, top_k: int, layers: int) -> tuple:
    base = {"hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": hidden // 4, "vocab_size": 1024, "max_position_embeddings": 4096}
    moe = ModelConfig.from_hf({"model_type": "qwen3_moe", **base, "intermediate_size": top_k * expert_width,
                               "num_experts": num_experts, "num_experts_per_tok": top_k,
                               "moe_intermediate_size": expert_width, "norm_topk_prob": True})
    dense = ModelConfig.from_hf({"model_type": "qwen3", **base, "intermediate_size": top_k * expert_width})
    models = []
    g = torch.Generator().manual_seed(0)
    for cfg in (moe, dense):
        m = build_model(cfg)
        with torch.no_grad():
            for p in m.parameters():
                p.copy_(torch.randn(p.shape, generator=g) / max(1.0, p.shape[-1] ** 0.5))
        models.append(m.eval().requires_grad_(False))
    return models


def time_alternating(fns: dict, repeats: int, inner: int) -> dict[str, float]:
    """Median ms per call of each fn, measured in alternating rounds."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():  # warm up
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            times[name].append((time.perf_counter() - t0) / inner * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def expected_experts_hit(num_experts: int, top_k: int, batch: int) -> float:
    return num_experts * (1 - (1 - top_k / num_experts) ** batch)


@torch.inference_mode()
def run(hidden: int, expert_width: int, num_experts: int, top_k: int, batch: int, layers: int, repeats: int) -> dict:
    moe, dense = make_models(hidden, expert_width, num_experts, top_k, layers)
    ids = torch.randint(0, 1024, (batch, 1), generator=torch.Generator().manual_seed(1))
    pos = torch.full((batch, 1), 7)
    h = torch.randn(batch, 1, hidden, generator=torch.Generator().manual_seed(2))
    model_ms = time_alternating({"moe": lambda: moe.forward_hidden(ids, pos), "dense": lambda: dense.forward_hidden(ids, pos)},
                                repeats, inner=20)
    block_ms = time_alternating({"moe": lambda: moe.layers[0].mlp(h), "dense": lambda: dense.layers[0].mlp(h)},
                                repeats, inner=50)
    hit = expected_experts_hit(num_experts, top_k, batch)
    return {
        "config": {"hidden": hidden, "expert_width": expert_width, "num_experts": num_experts, "top_k": top_k,
                   "batch": batch, "layers": layers, "threads": torch.get_num_threads()},
        "step_ms": model_ms, "step_ratio": model_ms["moe"] / model_ms["dense"],
        "mlp_ms": block_ms, "mlp_ratio": block_ms["moe"] / block_ms["dense"],
        "experts_hit": hit, "weight_bytes_ratio": hit / top_k,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--num-experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--sizes", default="64x32,256x128,1024x512", help="hidden x expert width, comma-separated")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for size in args.sizes.split(","):
        hidden, width = (int(x) for x in size.split("x"))
        r = run(hidden, width, args.num_experts, args.top_k, args.batch, args.layers, args.repeats)
        print(f"E={hidden:5d} I={width:4d} X={args.num_experts} k={args.top_k} B={args.batch}: "
              f"step moe {r['step_ms']['moe']:.3f} ms / dense {r['step_ms']['dense']:.3f} ms = {r['step_ratio']:.2f}x; "
              f"MLP block {r['mlp_ms']['moe']:.3f} / {r['mlp_ms']['dense']:.3f} ms = {r['mlp_ratio']:.2f}x; "
              f"experts hit {r['experts_hit']:.1f} -> MLP weight bytes {r['weight_bytes_ratio']:.1f}x dense")
        print(json.dumps(r))


if __name__ == "__main__":
    main()
