"""Run a whole module (every layer's copy of it) in fp32 activations and bf16 x bf16 matmuls with fp32 sums."""

from firstlight.bringup.remedies import Candidate, Remedy, matmul_rules, register, rule, scope_of


def propose(sig, ctx):
    scope = scope_of(sig, ctx)
    mm = {"a_format": "bf16", "b_format": "bf16", "accumulator": "fp32", "a_scaling": None, "b_scaling": None,
          "fidelity": "hifi4" if ctx.numerics.matmul.fidelity else None}
    mm = {k: v for k, v in mm.items() if v is not None or k.endswith("scaling")}
    return [Candidate("upcast_module", (rule(module=s, activation="fp32", why=sig.describe()),
                                        *matmul_rules(s, None, sig.describe(), **mm)),
                      f"upcast {s or 'the whole model'}", cost_rank=3) for s in dict.fromkeys((scope, None))]


register(Remedy("upcast_module", ("unit_composition", "quality_only", "op_class", "accumulation", "non_finite",
                               "decode_only", "position_divergence"),
                propose, cost="bf16 weights and fp32 activations in that module: its bytes and FLOPs at the slowest rate"))
