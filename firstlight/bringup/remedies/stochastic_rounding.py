"""Round the narrow accumulator stochastically: errors stop adding up in one direction (seeded, reproducible)."""

from firstlight.bringup.remedies import Candidate, Remedy, register, rule, scope_of
from firstlight.bringup.signatures import packet


def propose(sig, ctx):
    op = packet(getattr(sig, "op", "") or "aten.mm")
    if ctx.site(getattr(sig, "module", "") or "", op).matmul.rounding == "stochastic":
        return []
    return [Candidate("stochastic_rounding", (rule(module=scope_of(sig, ctx), op=op, matmul={"rounding": "stochastic"},
                                                   why=sig.describe()),), "stochastic rounding of the accumulator",
                      cost_rank=0)]


register(Remedy("stochastic_rounding", ("accumulation",), propose,
                cost="none where the hardware supports it (Trainium, some AI accelerators); a random source per add"))
