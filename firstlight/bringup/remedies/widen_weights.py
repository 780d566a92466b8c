"""Hold a module's weights in a wider format (bfp4 -> bfp8 -> bf16, mxfp4 -> mxfp6 -> mxfp8 -> bf16, fp8 -> bf16)."""

from firstlight.bringup.remedies import Candidate, Remedy, matmul_rules, register, scope_of
from firstlight.bringup.signatures import packet

LADDERS = (("bfp2_b", "bfp4_b", "bfp8_b", "bf16"), ("mxfp4", "mxfp6_e2m3", "mxfp8_e4m3", "bf16"),
           ("nvfp4", "fp8_e4m3", "bf16"), ("fp8_e5m2", "fp8_e4m3", "bf16"), ("fp8_e4m3fnuz", "bf16"),
           ("mxint8", "bf16"), ("fp16", "fp32"), ("bf16", "fp32"))


def ladder(fmt: str, chip_fmt: str | None = None) -> tuple[str, ...]:
    """The ladder holding `fmt`, and the chip's own weight format when given (bf16 is on several: an
    H100's is fp8's, never Tenstorrent's block floats)."""
    return next((lad for lad in LADDERS if fmt in lad and (chip_fmt is None or chip_fmt in lad)),
                next((lad for lad in LADDERS if fmt in lad), (fmt,)))


def _c(scope, fmt, why, rank):
    return Candidate("widen_weights", matmul_rules(scope, None, why, b_format=fmt, b_scaling=None),
                     f"weights in {fmt}" + (f" in {scope}" if scope else " everywhere"), cost_rank=rank)


def propose(sig, ctx):
    op = packet(getattr(sig, "op", "") or "aten.mm")
    if op not in ("aten.mm", "aten.addmm"):
        return []
    fmt = ctx.site(getattr(sig, "module", "") or "", op).matmul.b_format
    lad = ladder(fmt)
    wider = lad[lad.index(fmt) + 1:]
    if not wider or fmt in ("bf16", "fp32"):
        return []
    scope = scope_of(sig, ctx)
    return ([_c(scope, wider[0], sig.describe(), 2)] if scope else []) + [_c(None, wider[0], sig.describe(), 2)]


def cheaper(c, ctx):
    r = c.rules[0]
    lad = ladder(r.matmul.b_format, ctx.numerics.matmul.b_format if ctx is not None else None)
    return [_c(r.module, f, r.why, 1) for f in lad[:lad.index(r.matmul.b_format)]][::-1]


register(Remedy("widen_weights", ("op_class", "unit_composition", "quality_only", "accumulation", "decode_only"), propose,
                cheaper=cheaper, cost="weight bytes read per token grow with the format's bits (decode is bandwidth-bound)", primary=("op_class", "quality_only")))
