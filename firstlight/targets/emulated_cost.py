"""What an emulated configuration costs on its chip: prefill, one decode step, tokens/s.

The same roofline the simulator prices steps with (sim/cost.py; Williams, Waterman & Patterson,
CACM 2009), applied to the model's own modules under the emulated configuration, so that a format,
fidelity or host fallback chosen for correctness shows its price:

    linear    max(2 m N K / rate(a, b, fidelity), N K bytes(b_format) / bw) + one kernel launch
    attention max(4 H D ctx m / rate(attention), 2 Hkv D ctx bytes(activation) / bw) per layer
    host      per fallback op per step: 2 x link latency + bytes / link bandwidth

rate(a, b, fidelity) is `numerics.fidelity_tflops[fidelity]` where the chip prices fidelity, else the
chip's `compute_tflops` for the wider operand format; rates and bandwidth take the spec's
`efficiency` fractions, as the simulator does. Batch 1; decode at the prompt's context length.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from firstlight.core.hardware import DTYPE_BYTES, HardwareSpec, MatmulNumericsSpec
from firstlight.numerics import get_format

# the DTYPE_BYTES / compute_tflops name a format is priced as
_DTYPE_OF = {"fp32": "fp32", "tf32": "tf32", "bf16": "bf16", "fp16": "fp16", "bfp8_b": "bfp8", "bfp4_b": "bfp4",
             "bfp2_b": "bfp2", "mxfp8_e4m3": "mxfp8", "mxfp8_e5m2": "mxfp8", "mxfp6_e3m2": "mxfp6",
             "mxfp6_e2m3": "mxfp6", "mxfp4": "mxfp4", "mxint8": "mxint8", "nvfp4": "nvfp4"}


def dtype_of(fmt: str) -> str:
    """The simulator's dtype name for a numerics format (fp8 variants are 'fp8')."""
    if fmt in _DTYPE_OF:
        return _DTYPE_OF[fmt]
    if fmt.startswith("fp8"):
        return "fp8"
    bits = get_format(fmt).bits_per_value
    return min(DTYPE_BYTES, key=lambda d: abs(DTYPE_BYTES[d] * 8 - bits))


def matmul_flops_per_s(hw: HardwareSpec, m: MatmulNumericsSpec) -> float:
    n = hw.numerics
    if m.fidelity and n is not None and m.fidelity in n.fidelity_tflops:
        peak = n.fidelity_tflops[m.fidelity] * 1e12
    else:
        wider = max((dtype_of(m.a_format), dtype_of(m.b_format)), key=lambda d: DTYPE_BYTES[d])
        peak = hw.flops_per_s(wider)
    return peak * hw.efficiency.compute


def _linears(model: nn.Module) -> list[tuple[str, int, int]]:
    """(path, N, K) of every weight matmul; a tied LM head counts once more (it is read again)."""
    return [(p, mod.out_features, mod.in_features) for p, mod in model.named_modules() if isinstance(mod, nn.Linear)]


def predict(model: nn.Module, hw: HardwareSpec, site: Callable[[str, str], Any], last_forward: dict[str, float],
            prompt_len: int = 128) -> dict[str, Any]:
    """Predicted prefill (prompt_len tokens), decode step and tokens/s at batch 1 on `hw`."""
    cfg = model.config
    eff = hw.efficiency
    bw = hw.memory.bandwidth_bytes_per_s * eff.memory
    gemv_bw = hw.memory.bandwidth_bytes_per_s * (eff.gemv_memory if eff.gemv_memory is not None else eff.memory)

    def combine(t_compute: float, t_memory: float) -> float:  # the spec's overlap form, as sim/cost.py
        return t_compute + t_memory if eff.overlap == "additive" else max(t_compute, t_memory)

    kernel_s = hw.efficiency.kernel_overhead_us * 1e-6
    step_s = hw.efficiency.step_overhead_us * 1e-6
    lins = _linears(model)
    attn = site("layers.0.self_attn", "aten.bmm")
    act_bytes = DTYPE_BYTES[dtype_of(site("", "aten.add").activation)]
    attn_rate = matmul_flops_per_s(hw, attn.matmul)
    weight_bytes = 0.0
    host = hw.numerics.host_fallback if hw.numerics else None
    tokens = max(last_forward.get("tokens", 1.0), 1.0)
    host_calls = last_forward.get("host_calls", 0.0)
    host_bytes_per_token = last_forward.get("host_bytes", 0.0) / tokens
    kernels = last_forward.get("compute_ops") or (len(lins) + 8 * cfg.num_layers)

    def step(m: int, ctx: float) -> tuple[float, float]:
        nonlocal weight_bytes
        t_lin = 0.0
        weight_bytes = 0.0
        for path, n_out, k_in in lins:
            s = site(path, "aten.mm")
            wb = n_out * k_in * DTYPE_BYTES[dtype_of(s.matmul.b_format)]
            weight_bytes += wb
            t_lin += combine(2.0 * m * n_out * k_in / matmul_flops_per_s(hw, s.matmul), wb / (gemv_bw if m == 1 else bw))
        pairs = m * ctx if m == 1 else m * (m + 1) / 2 + m * (ctx - m)  # causal prefill or one query
        flops = 4.0 * cfg.num_heads * cfg.head_dim * pairs * cfg.num_layers
        kv = 2.0 * cfg.num_kv_heads * cfg.head_dim * ctx * act_bytes * cfg.num_layers
        t_attn = combine(flops / attn_rate, kv / bw)
        t_host = 0.0
        if host_calls and host is not None:
            t_host = host_calls * 2 * host.latency_us * 1e-6 + host_bytes_per_token * m / (host.bandwidth_gbps * 1e9)
        return t_lin + t_attn + kernels * kernel_s + step_s + t_host, t_host

    prefill_s, _ = step(prompt_len, prompt_len)
    decode_s, host_s = step(1, prompt_len + 1)
    return {"chip": hw.name, "batch": 1, "prompt_len": prompt_len, "prefill_ms": prefill_s * 1e3,
            "decode_step_ms": decode_s * 1e3, "decode_tokens_per_s": 1.0 / decode_s,
            "weight_bytes": weight_bytes, "host_fallback_ms_per_step": host_s * 1e3,
            "kernels_per_step": kernels, "formula": "roofline per linear + attention + launches (targets/emulated_cost.py)"}
