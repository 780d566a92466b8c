"""Where a single-stream decode step's time goes: torch.profiler over engine decode steps, ops grouped
by class (matmul kernels, attention, KV gather/scatter, elementwise, ...), and the rest of the step's
wall time (Python, dispatch, scheduler, sampler) as overhead.

    PYTHONPATH=. .venv/bin/python benchmarks/decode_profile.py --model smollm2-135m --threads 2 \
        --quantization int4 --modes eager,native,compiled

Modes: eager = the model's modules op by op (`EngineConfig(native_decode=False)`); native = every layer in one
firstlight::dense_decode call (engine/native_decode.py; its matmuls, attention and glue are one op to the
profiler); compiled = `compile_decode=True`. A mode may name a KV-cache storage after a colon (`native:bf16`,
`eager:fp16`: `--kv-cache-dtype`), so two caches run side by side in one process.
--batch requests per mode (default 1; engines over the same model), prompts of 128 random ids,
greedy with EOS ignored; each engine runs the prefill and 8 warm-up decode steps (the compiled one
builds its graph there) before timed rounds that alternate between the modes. Op times are the
profiler's self CPU time per op, summed per class and divided by the number of steps; "overhead" =
median step wall time (unprofiled, same run) - profiled op time per step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict

import torch

CLASSES = (  # first match wins; names are aten / quantized op names as the profiler reports them
    ("native step: all layers (matmuls + glue)", ("firstlight::dense_decode",)),
    ("matmul: int4 packed", ("_weight_int4pack_mm", "firstlight::int4_mm")),  # and int4_mm_a8
    ("matmul: int8 packed", ("_weight_int8pack_mm", "firstlight::int8_mm")),
    ("matmul: fbgemm int8", ("quantized::linear",)),
    ("matmul: fp32/bf16", ("firstlight::f32_mm", "mkldnn::_linear_pointwise", "aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")),
    ("attention (SDPA)", ("scaled_dot_product", "_flash_attention", "_efficient_attention")),
    ("KV gather/scatter", ("index_select", "index_copy", "aten::gather", "aten::index")),
    ("compiled graph (inductor kernels)", ("CompiledFxGraph", "CompiledFunction", "Torch-Compiled Region",
                                           "int4mm_packed_weight_cpu")),
    ("dynamo guards / bytecode", ("TorchDynamo Cache Lookup", "Pregraph bytecode")),
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


def make_engine(model, tok, args: argparse.Namespace, mode: str, total: int):
    from firstlight.engine.engine import EngineConfig, LLMEngine
    from firstlight.engine.request import SamplingParams

    path, _, kv = mode.partition(":")
    engine = LLMEngine(model, tok, EngineConfig(block_size=16, num_blocks=64 + 32 * args.batch, max_num_seqs=args.batch,
                                                compile_decode=path == "compiled", native_decode=path == "native",
                                                kv_cache_dtype=kv or "auto"))
    if path == "native" and engine.runner.native_decode is None:
        raise SystemExit(f"native mode: the engine declined it ({engine.runner.native_decode_declined})")
    g = torch.Generator().manual_seed(0)
    for _ in range(args.batch):
        prompt = torch.randint(10, model.config.vocab_size - 10, (args.prompt_len,), generator=g).tolist()
        engine.add_request(prompt, SamplingParams(max_tokens=total, temperature=0.0, ignore_eos=True))
    t0 = time.perf_counter()
    engine.step()  # prefill
    ttft = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(8):  # warm-up decode steps (and the compiled graph)
        engine.step()
    return engine, ttft, time.perf_counter() - t0


def profile(engine, steps: int) -> tuple[dict[str, float], list[tuple[str, float]]]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    by_class: dict[str, float] = defaultdict(float)
    top: dict[str, float] = defaultdict(float)
    for evt in prof.key_averages():
        if evt.self_cpu_time_total <= 0:
            continue
        by_class[op_class(evt.key)] += evt.self_cpu_time_total / 1e3 / steps
        top[evt.key] += evt.self_cpu_time_total / 1e3 / steps
    return dict(by_class), sorted(top.items(), key=lambda kv: -kv[1])[:10]


def run(args: argparse.Namespace) -> dict:
    """One engine per mode over one model; timed rounds alternate between them (load drift on a
    shared machine hits both), then each is profiled once."""
    from firstlight.models import hub
    from firstlight.models.loader import load_model
    from firstlight.quant import apply_quantization
    from firstlight.quant.f32 import use_f32_kernel

    model, tok = load_model(hub.resolve(args.model))
    report = apply_quantization(model, args.quantization)
    use_f32_kernel(model)  # as the server loads it (engine/llm.py): fp32 linears left run on firstlight::f32_mm
    total = 8 + (args.rounds + 1) * args.steps + 8
    modes = {m: make_engine(model, tok, args, m, total) for m in args.modes}
    walls: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.rounds):
        for m, (engine, _, _) in modes.items():
            for _ in range(args.steps):
                t = time.perf_counter()
                engine.step()
                walls[m].append(time.perf_counter() - t)
    out = {"kernel": report.kernel if report else "float32 dense", "modes": {}}
    for m, (engine, ttft, warm) in modes.items():
        by_class, top = profile(engine, args.steps)
        out["modes"][m] = {"step_ms": 1e3 * statistics.median(walls[m]), "ttft_ms": 1e3 * ttft, "warmup_s": warm,
                           "by_class": by_class, "top": top, "graphs": engine.runner.num_decode_compiles}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quantization", default="int4")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1, help="requests decoding together (default: single stream)")
    ap.add_argument("--steps", type=int, default=16, help="decode steps per timed round and per profile")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default="eager,native,compiled")
    args = ap.parse_args()
    args.modes = args.modes.split(",")
    torch.set_num_threads(args.threads)
    r = run(args)
    load = os.getloadavg()
    print(f"{args.model} {args.quantization} ({r['kernel']}), batch {args.batch}, {args.threads} thread(s), load average "
          f"{load[0]:.1f} {load[1]:.1f} {load[2]:.1f} on {os.cpu_count()} CPUs; step = median of "
          f"{args.rounds} x {args.steps} alternating decode steps; op times from one profiled block of {args.steps}")
    modes = r["modes"]
    print(f"{'':<36}" + "".join(f"{m + ' ms':>12} {'share':>6}" for m in modes))
    line = f"{'decode step (wall)':<36}" + "".join(f"{v['step_ms']:12.2f} {'':>6}" for v in modes.values())
    print(line)
    classes = sorted({c for v in modes.values() for c in v["by_class"]},
                     key=lambda c: -max(v["by_class"].get(c, 0) for v in modes.values()))
    for c in classes:
        print(f"{c:<36}" + "".join(f"{v['by_class'].get(c, 0):12.2f} {v['by_class'].get(c, 0) / v['step_ms']:6.1%}"
                                   for v in modes.values()))
    print(f"{'overhead (wall - profiled ops)':<36}" + "".join(
        f"{v['step_ms'] - sum(v['by_class'].values()):12.2f} "
        f"{(v['step_ms'] - sum(v['by_class'].values())) / v['step_ms']:6.1%}" for v in modes.values()))
    for m, v in modes.items():
        print(f"{m}: {args.batch * 1e3 / v['step_ms']:.1f} tok/s; prefill {v['ttft_ms']:.0f} ms; first 8 decode steps "
              f"{v['warmup_s']:.1f} s (compile included); graphs {v['graphs']}")
        print("  top ops (ms/step): " + ", ".join(f"{k[:48]} {t:.2f}" for k, t in v["top"]))


if __name__ == "__main__":
    main()
