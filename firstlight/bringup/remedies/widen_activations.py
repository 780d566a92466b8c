"""Feed a matmul bf16 activations instead of fp8 / block-float ones."""

from firstlight.bringup.remedies import Candidate, Remedy, matmul_rules, register, scope_of
from firstlight.bringup.signatures import packet


def propose(sig, ctx):
    op = packet(getattr(sig, "op", "") or "aten.mm")
    if not op.endswith(("mm", "bmm")):
        return []
    site = ctx.site(getattr(sig, "module", "") or "", op)
    if site.matmul.a_format in ("bf16", "fp16", "fp32"):
        return []
    return [Candidate("widen_activations", matmul_rules(scope, None, sig.describe(), a_format="bf16", a_scaling=None),
                      "bf16 activations into the matmul" + (f" in {scope}" if scope else " everywhere"), cost_rank=2)
            for scope in dict.fromkeys((scope_of(sig, ctx), None))]


register(Remedy("widen_activations", ("op_class", "unit_composition", "quality_only", "accumulation", "decode_only"), propose,
                cost="the matmul runs at the wider format's rate (fp8 -> bf16 halves peak FLOPs)", primary=("op_class",)))
