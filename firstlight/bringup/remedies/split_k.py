"""Split K into chunks reduced separately and summed in fp32 (each narrow sum is shorter)."""

from firstlight.bringup.remedies import Candidate, Remedy, register, rule, scope_of
from firstlight.bringup.signatures import packet


def propose(sig, ctx):
    k = getattr(sig, "reduction_len", None)
    if not k or k < 128:
        return []
    scope = scope_of(sig, ctx)
    op = packet(sig.op)
    # each split is a whole number of the chip's MMA depth (its narrow sum is rounded per MMA)
    step = ctx.site(getattr(sig, "module", "") or "", op).matmul.mma_k or 32
    out = []
    for s in (4,):
        interval = max(step, -(-k // s // step) * step)
        out.append(Candidate("split_k", (rule(module=scope, op=op, matmul={"promotion_interval": interval},
                                               why=sig.describe()),), f"split K={k} in {s} ({scope})", cost_rank=2))
    return out


register(Remedy("split_k", ("accumulation",), propose,
                cost="an fp32 reduction of the split partials: one extra pass over the output per split", primary=("accumulation",)))
