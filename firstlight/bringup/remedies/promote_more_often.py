"""Promote the narrow partial sum into fp32 every N products along K (DeepSeek-V3's FP8 GEMM: N = 128)."""

from firstlight.bringup.remedies import Candidate, Remedy, register, rule
from firstlight.bringup.signatures import NARROW_ACCUMULATORS, packet

INTERVALS = (128, 256, 512)


def _c(scope, op, n, why):
    return Candidate("promote_more_often", (rule(module=scope, op=op, matmul={"promotion_interval": n}, why=why),),
                     f"promote to fp32 every {n} of K" + (f" in {scope}" if scope else " everywhere"), cost_rank=2)


def propose(sig, ctx):
    op = packet(getattr(sig, "op", "") or "aten.mm")
    site = ctx.site(getattr(sig, "module", "") or "", op)
    if not op.endswith(("mm", "bmm")) or site.matmul.accumulator not in NARROW_ACCUMULATORS:
        return []
    current = site.matmul.promotion_interval
    n = max((i for i in INTERVALS if current is None or i < current), default=None, key=lambda i: -i)
    return [] if n is None else [_c(None, None, n, sig.describe())]


def cheaper(c, ctx):
    r = c.rules[0]
    return [_c(r.module, r.op, n, r.why) for n in INTERVALS if n > r.matmul.promotion_interval]


register(Remedy("promote_more_often", ("accumulation",), propose, cheaper=cheaper,
                cost="one fp32 add of the partial tile per interval (CUDA cores on Hopper): a few % of GEMM time", primary=("accumulation",)))
