"""Scale fp8 operands per block of 128 along K instead of once per tensor (DeepSeek-V3's 1x128 activation
and 128-wide weight blocks): one outlier no longer crushes the resolution of a whole tensor."""

from firstlight.bringup.remedies import Candidate, Remedy, matmul_rules, register, scope_of
from firstlight.bringup.signatures import packet

BLOCK = "block:128"


def _variant(scope, block, why):
    return Candidate("finer_scaling", matmul_rules(scope, None, why, a_scaling=block, b_scaling=block),
                     f"fp8 scales per {block.split(':')[1]} of K" + (f" in {scope}" if scope else " everywhere"),
                     cost_rank=0)


def propose(sig, ctx):
    op = packet(getattr(sig, "op", "") or "aten.mm")
    if not op.endswith(("mm", "bmm")):
        return []
    mm = ctx.site(getattr(sig, "module", "") or "", op).matmul
    if "tensor" not in (mm.a_scaling, mm.b_scaling):
        return []
    return [_variant(scope, BLOCK, sig.describe()) for scope in dict.fromkeys((scope_of(sig, ctx), None))]


def cheaper(c, ctx):
    r = c.rules[0]
    return [_variant(r.module, "block:512", r.why)]


register(Remedy("finer_scaling", ("op_class", "quality_only", "accumulation", "unit_composition", "decode_only"), propose,
                cost="one fp32 scale multiply per 128 of K in the GEMM's epilogue (DeepSeek-V3 ran it on H800 "
                     "with promotion to CUDA cores); ~none in bytes", cheaper=cheaper, primary=("op_class", "quality_only")))
