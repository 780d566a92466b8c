"""Split K into chunks reduced separately and summed in fp32 (each narrow sum is shorter)."""

from firstlight.bringup.remedies import Candidate, Remedy, register, rule, scope_of
from firstlight.bringup.signatures import packet


def propose(sig, ctx):
    k = getattr(sig, "reduction_len", None)
    if not k or k < 128:
        return []
    scope = scope_of(sig)
    op = packet(sig.op)
    return [Candidate("split_k", (rule(module=scope, op=op, matmul={"promotion_interval": max(32, k // s)},
                                       why=sig.describe()),), f"split K={k} in {s} ({scope})", cost_rank=2)
            for s in (4,)]


register(Remedy("split_k", ("accumulation",), propose,
                cost="an fp32 reduction of the split partials: one extra pass over the output per split", primary=("accumulation",)))
