"""Where a single-stream decode step's time goes: torch.profiler over engine decode steps, ops grouped
by class (matmul kernels, attention, KV gather/scatter, elementwise, ...), and the rest of the step's
wall time (Python, dispatch, scheduler, sampler) as overhead.

    PYTHONPATH=. .venv/bin/python benchmarks/decode_profile.py --model smollm2-135m --threads 1 \
        --quantization int4 --steps 32 [--compile]

One request, prompt 128 random ids, greedy with EOS ignored; the engine runs the prefill and a few
warm-up decode steps (and, with --compile, builds its graph) before the profiled steps. Op times are
the profiler's self CPU time per op, summed per class and divided by the number of steps; "overhead"
= median step wall time (unprofiled steps, same run) - profiled op time per step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict

import torch

CLASSES = (  # first match wins; names are aten / quantized op names as the profiler reports them
    ("matmul: int4 packed", ("_weight_int4pack_mm",)),
    ("matmul: int8 packed", ("_weight_int8pack_mm",)),
    ("matmul: fbgemm int8", ("quantized::linear",)),
    ("matmul: fp32/bf16", ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")),
    ("attention (SDPA)", ("scaled_dot_product", "_flash_attention", "_efficient_attention")),
    ("KV gather/scatter", ("index_select", "index_copy", "aten::gather", "aten::index")),
    ("compiled graph (inductor kernels)", ("CompiledFunction", "Torch-Compiled Region", "inductor")),
    ("dtype casts / copies", ("aten::to", "aten::_to_copy", "aten::copy_", "aten::contiguous", "aten::clone")),
    ("embedding", ("aten::embedding",)),
    ("views / allocation", ("aten::as_strided", "aten::empty", "aten::reshape", "aten::view", "aten::transpose",
                            "aten::split", "aten::slice", "aten::select", "aten::unsqueeze", "aten::expand",
                            "aten::t", "aten::detach", "aten::alias", "aten::narrow", "aten::resize_",
                            "aten::_unsafe_view", "aten::chunk", "aten::squeeze", "aten::permute")),
    ("elementwise / reductions", ("aten::mul", "aten::add", "aten::sub", "aten::div", "aten::neg", "aten::rsqrt",
                                  "aten::pow", "aten::mean", "aten::silu", "aten::cat", "aten::sigmoid", "aten::where",
                                  "aten::exp", "aten::tanh", "aten::gelu", "aten::amax", "aten::abs", "aten::clamp")),
)


def op_class(name: str) -> str:
    for cls, keys in CLASSES:
        if any(k in name for k in keys):
            return cls
    return "other ops"


def run(args: argparse.Namespace) -> dict:
    from firstlight.engine.engine import EngineConfig, LLMEngine
    from firstlight.engine.request import SamplingParams
    from firstlight.models import hub
    from firstlight.models.loader import load_model
    from firstlight.quant import apply_quantization

    model, tok = load_model(hub.resolve(args.model))
    report = apply_quantization(model, args.quantization)
    engine = LLMEngine(model, tok, EngineConfig(block_size=16, num_blocks=64, max_num_seqs=1,
                                                compile_decode=args.compile))
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(10, model.config.vocab_size - 10, (args.prompt_len,), generator=g).tolist()
    total = 8 + 2 * args.steps
    engine.add_request(prompt, SamplingParams(max_tokens=total, temperature=0.0, ignore_eos=True))
    t0 = time.perf_counter()
    engine.step()  # prefill
    ttft = time.perf_counter() - t0
    for _ in range(8):  # warm-up decode steps (and the compiled graph)
        engine.step()
    walls = []
    for _ in range(args.steps):
        t = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t)
    step_ms = 1e3 * statistics.median(walls)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            engine.step()
    by_class: dict[str, float] = defaultdict(float)
    top: dict[str, float] = defaultdict(float)
    for evt in prof.key_averages():
        if evt.self_cpu_time_total <= 0:
            continue
        by_class[op_class(evt.key)] += evt.self_cpu_time_total / 1e3 / args.steps
        top[evt.key] += evt.self_cpu_time_total / 1e3 / args.steps
    op_ms = sum(by_class.values())
    return {"step_ms": step_ms, "ttft_ms": 1e3 * ttft, "op_ms": op_ms, "by_class": dict(by_class),
            "top": sorted(top.items(), key=lambda kv: -kv[1])[:12],
            "kernel": report.kernel if report else "float32 dense", "compile": args.compile,
            "graphs": engine.runner.num_decode_compiles}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quantization", default="int4")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--compile", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    r = run(args)
    load = os.getloadavg()
    print(f"{args.model} {args.quantization} ({r['kernel']}), {'compiled' if r['compile'] else 'eager'} decode, "
          f"{args.threads} thread(s), load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} on {os.cpu_count()} CPUs")
    print(f"decode step {r['step_ms']:.2f} ms (median of {args.steps}) = {1e3 / r['step_ms']:.1f} tok/s; "
          f"prefill of {args.prompt_len} tokens {r['ttft_ms']:.0f} ms; graphs {r['graphs']}")
    print(f"{'class':<36} {'ms/step':>8} {'share':>6}")
    for cls, ms in sorted(r["by_class"].items(), key=lambda kv: -kv[1]):
        print(f"{cls:<36} {ms:8.2f} {ms / r['step_ms']:6.1%}")
    overhead = r["step_ms"] - r["op_ms"]
    print(f"{'overhead (Python, dispatch, rest)':<36} {overhead:8.2f} {overhead / r['step_ms']:6.1%}")
    print("top ops (ms/step): " + ", ".join(f"{k} {v:.2f}" for k, v in r["top"]))


if __name__ == "__main__":
    main()
