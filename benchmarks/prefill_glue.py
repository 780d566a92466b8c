"""The glue of a prefill step on our kernels vs torch's ops (quant/f32.py: FusedRMSNorm, KernelAttention's
rope, FusedGatedMLP's activation), op by op at one prefill chunk of the servers workload (14 prompts x 142
tokens of SmolLM2-135M: E 576, 9 heads and 3 KV heads of 64, MLP 1,536), next to each op's bound (a copy of
as many bytes as it reads and writes, into a tensor made once: these operands fit the L3 cache, so a copy from
memory is no bound), with each path's minor page faults per call (a fresh output tensor whose pages the
allocator gave back to the OS is faulted in again: glibc's heap history decides, per process, whether torch's
ops pay that); then end to end, in process: the servers benchmark's fp32
c = 32 workload (32 prompts of 142 random tokens, 32 output tokens, `EngineConfig(max_num_seqs=32)`) with the
norms and rope on the kernels and on torch's modules, alternating rounds (the activation stays on its kernel in
both: it has no torch path in the swapped modules' place).

    PYTHONPATH=. .venv/bin/python benchmarks/prefill_glue.py --threads 2 --rounds 8
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from collections.abc import Callable

import torch
from _common import median_time

from firstlight import kernels
from firstlight.models.layers import ACTIVATIONS, Attention, RMSNorm, apply_rope, rope_cos_sin
from firstlight.quant.f32 import FusedRMSNorm, KernelAttention


def faults_per_call(fn: Callable[[], object], calls: int = 10) -> float:
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(calls):
        fn()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / calls


def ops(repeats: int) -> None:
    b, s, e, h, hkv, d, inter = 14, 142, 576, 9, 3, 64, 1536
    x = torch.randn(b, s, e)
    norm = RMSNorm(e, 1e-5).requires_grad_(False)
    qkv = torch.randn(b, s, (h + 2 * hkv) * d)
    q = qkv[..., : h * d].reshape(b, s, h, d).transpose(1, 2)  # Attention's view of the projection
    cos, sin = rope_cos_sin(1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)), torch.arange(s).expand(b, s),
                            torch.float32)
    gate_up = torch.randn(b * s, 2 * inter)
    silu = ACTIVATIONS["silu"]
    rows = b * s
    cases = [  # (op, torch's, ours, bytes read + written)
        ("rms_norm", lambda: norm(x), lambda: kernels.rms_norm(x, norm.weight, norm.eps), 2 * rows * e * 4),
        ("rope (q)", lambda: apply_rope(q, cos, sin), lambda: kernels.rope(q, cos, sin), 2 * rows * h * d * 4),
        ("gated act", lambda: silu(gate_up[:, :inter]) * gate_up[:, inter:], lambda: kernels.gated_act(gate_up, "silu"),
         3 * rows * inter * 4),
    ]
    print(f"\none prefill chunk, {rows} tokens; ms per call, medians of {repeats}")
    print("| op | torch ms | ours ms | torch / ours | bound ms (a copy of its bytes) | ours / bound | page faults "
          "per call, torch / ours |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    with torch.inference_mode():
        for name, ref, ours, nbytes in cases:
            src, dst = torch.empty(nbytes // 8), torch.empty(nbytes // 8)  # fp32: half read, half written
            t_ref, t_ours = median_time(ref, repeats), median_time(ours, repeats)
            bound = median_time(lambda: dst.copy_(src), repeats)  # noqa: B023
            print(f"| {name} | {t_ref * 1e3:.3f} | {t_ours * 1e3:.3f} | {t_ref / t_ours:.2f}x | {bound * 1e3:.3f} | "
                  f"{t_ours / bound:.1f}x | {faults_per_call(ref):.0f} / {faults_per_call(ours):.0f} |")


def end_to_end(rounds: int) -> None:
    from firstlight.engine.engine import EngineConfig, LLMEngine
    from firstlight.engine.llm import load
    from firstlight.engine.request import SamplingParams

    model, tok = load("smollm2-135m", quantization=None)
    prompts = torch.randint(10, 49000, (32, 142), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=32, enable_prefix_caching=False))

    def run() -> float:
        for p in prompts:
            engine.add_request(p, params)
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        return time.perf_counter() - t0

    def use_kernels(on: bool) -> None:
        for m in model.modules():
            if type(m) in (RMSNorm, FusedRMSNorm):
                m.__class__ = FusedRMSNorm if on else RMSNorm
            elif type(m) in (Attention, KernelAttention):
                m.__class__ = KernelAttention if on else Attention

    run()  # warm: oneDNN's reordered weights, the kernels' first calls
    times: dict[str, list[float]] = {"torch's norms and rope": [], "on our kernels": []}
    for _ in range(rounds):
        for arm in times:
            use_kernels(arm == "on our kernels")
            times[arm].append(run())
    print(f"\nend to end, 32 x 142-token prompts, 32 output tokens, fp32; s, {rounds} alternating rounds")
    for arm, ts in times.items():
        print(f"{arm}: median {statistics.median(ts):.3f} s ({', '.join(f'{t:.2f}' for t in ts)})")
    ratio = statistics.median(times["on our kernels"]) / statistics.median(times["torch's norms and rope"])
    print(f"kernels / torch: {ratio:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=8, help="end-to-end rounds per arm (0: the op table only)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    isa = kernels.load_kernel()
    if isa is None:
        raise SystemExit("firstlight's kernel extension is not in use here (FIRSTLIGHT_CPU_KERNELS / build)")
    print(f"{args.threads} thread(s), kernel build {isa}")
    ops(args.repeats)
    if args.rounds:
        end_to_end(args.rounds)


if __name__ == "__main__":
    main()
