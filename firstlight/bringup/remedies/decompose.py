"""Spell an op the compiler lacks (or computes badly) in ops it lowers."""

from firstlight.bringup.remedies import Candidate, Remedy, register, rule
from firstlight.bringup.signatures import packet
from firstlight.targets.emulated_ops import DECOMPOSITIONS


def propose(sig, ctx):
    op = packet(getattr(sig, "op", ""))
    if op not in DECOMPOSITIONS:
        return []
    scope = None if sig.kind == "op_not_lowered" else getattr(sig, "module", None)
    return [Candidate("decompose", (rule(op=op, module=scope, decompose=True, why=sig.describe()),),
                      f"decompose {op} into lowered ops", cost_rank=1)]


register(Remedy("decompose", ("op_not_lowered", "op_class"), propose,
                cost="a few more kernels per call (the ops it is made of)", primary=("op_not_lowered",)))
