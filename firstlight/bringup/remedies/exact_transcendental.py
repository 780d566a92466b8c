"""Compute exp / reciprocal / GELU / ... exactly instead of with the vector unit's fast approximation:
the op verify named, or, when it named none, every op the chip approximates."""

from firstlight.bringup.remedies import Candidate, Remedy, register, rule, scope_of
from firstlight.bringup.signatures import packet
from firstlight.targets.emulated_ops import APPROX_OPS

SOFTMAX_PARTS = ("aten.exp", "aten.reciprocal")


def propose(sig, ctx):
    op = packet(getattr(sig, "op", ""))
    if not op:  # nothing named (a compound error over the whole model): every op the chip approximates
        return _everywhere(sig, ctx)
    ops = SOFTMAX_PARTS if "softmax" in op else (op,)
    module = getattr(sig, "module", "") or ""
    if not any((ctx.site(module, o).impl or "exact") != "exact" for o in ops):
        return []
    scope = scope_of(sig, ctx)
    return [Candidate("exact_transcendental", tuple(rule(op=o, module=s, transcendental="exact", why=sig.describe())
                                                    for o in ops), f"exact {'/'.join(ops)}" + (f" in {s}" if s else ""),
                      cost_rank=1) for s in dict.fromkeys((scope, None))]


def _everywhere(sig, ctx):
    ops = [op for op, fn in APPROX_OPS.items() if fn in ctx.numerics.transcendentals
           and (ctx.site("", op).impl or "exact") != "exact"]
    if not ops:
        return []
    return [Candidate("exact_transcendental", tuple(rule(op=o, transcendental="exact", why=sig.describe()) for o in ops),
                      f"exact {'/'.join(ops)} everywhere", cost_rank=2)]


register(Remedy("exact_transcendental", ("op_class", "non_finite", "unit_composition", "quality_only", "decode_only"), propose,
                cost="the accurate vector-unit path: ~2-4x the cycles of the approximation for that op", primary=("op_class", "non_finite", "decode_only")))
