"""Raise the matrix unit's math fidelity (Tenstorrent LoFi -> HiFi2 -> HiFi3 -> HiFi4)."""

from firstlight.bringup.remedies import Candidate, Remedy, register, rule, scope_of
from firstlight.bringup.signatures import packet
from firstlight.numerics import FIDELITIES


def _variant(scope, op, fid, why):
    # rank 1: the strongest fidelity is tried early; the performance phase then tries the cheaper ones
    return Candidate("raise_fidelity", (rule(module=scope, op=op, matmul={"fidelity": fid}, why=why),),
                     f"math fidelity {fid}" + (f" in {scope}" if scope else " everywhere"), cost_rank=1)


def propose(sig, ctx):
    """The highest fidelity, first where it failed (every layer), then everywhere; cheaper later."""
    op = packet(getattr(sig, "op", "") or "aten.mm")
    if not op.endswith(("mm", "bmm")):
        return []
    fid = ctx.site(getattr(sig, "module", "") or "", op).matmul.fidelity
    if fid is None or fid == FIDELITIES[-1]:
        return []
    scope = scope_of(sig, ctx)
    out = [_variant(scope, op, FIDELITIES[-1], sig.describe())] if scope else []
    return out + [_variant(None, None, FIDELITIES[-1], sig.describe())]


def cheaper(c, ctx):
    r = c.rules[0]
    fid = r.matmul.fidelity
    return [_variant(r.module, r.op, f, r.why) for f in reversed(FIDELITIES[:FIDELITIES.index(fid)])]


register(Remedy("raise_fidelity", ("accumulation", "op_class", "unit_composition", "quality_only", "decode_only"), propose,
                cost="matmul throughput / phases: HiFi2 halves LoFi's rate, HiFi4 quarters it", cheaper=cheaper, primary=("op_class", "quality_only")))
