"""Accumulate matmul partial sums in fp32 (Tenstorrent fp32_dest_acc_en; an fp32 accumulator elsewhere)."""

from firstlight.bringup.remedies import Candidate, Remedy, register, rule, scope_of
from firstlight.bringup.signatures import NARROW_ACCUMULATORS, packet


def propose(sig, ctx):
    op = packet(getattr(sig, "op", "") or "aten.mm")
    if not op.endswith(("mm", "bmm")) or ctx.site(getattr(sig, "module", "") or "", op).matmul.accumulator \
            not in NARROW_ACCUMULATORS:
        return []
    scope = scope_of(sig, ctx)
    out = [Candidate("widen_accumulator", (rule(module=scope, op=op, matmul={"accumulator": "fp32"}, why=sig.describe()),),
                     f"fp32 accumulator in {scope}", cost_rank=1)] if scope else []
    return out + [Candidate("widen_accumulator", (rule(matmul={"accumulator": "fp32"}, why=sig.describe()),),
                            "fp32 accumulator everywhere", cost_rank=1)]


register(Remedy("widen_accumulator", ("accumulation", "op_class", "unit_composition", "quality_only", "decode_only"), propose,
                cost="on Tenstorrent, half the Dst register tiles (smaller matmul subblocks); elsewhere ~none", primary=("accumulation",)))
