"""Compute exp / reciprocal / GELU / ... exactly instead of with the vector unit's fast approximation."""

from firstlight.bringup.remedies import Candidate, Remedy, register, rule, scope_of
from firstlight.bringup.signatures import packet

SOFTMAX_PARTS = ("aten.exp", "aten.reciprocal")


def propose(sig, ctx):
    op = packet(getattr(sig, "op", ""))
    ops = SOFTMAX_PARTS if "softmax" in op else (op,)
    module = getattr(sig, "module", "") or ""
    if not any((ctx.site(module, o).impl or "exact") != "exact" for o in ops):
        return []
    scope = scope_of(sig)
    return [Candidate("exact_transcendental", tuple(rule(op=o, module=s, transcendental="exact", why=sig.describe())
                                                    for o in ops), f"exact {'/'.join(ops)}" + (f" in {s}" if s else ""),
                      cost_rank=1) for s in dict.fromkeys((scope, None))]


register(Remedy("exact_transcendental", ("op_class", "non_finite", "unit_composition"), propose,
                cost="the accurate vector-unit path: ~2-4x the cycles of the approximation for that op", primary=("op_class", "non_finite")))
