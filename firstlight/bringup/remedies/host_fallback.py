"""Run one op on the host in fp32: always possible, never fast (a round trip per call)."""

from firstlight.bringup.remedies import Candidate, Remedy, register, rule
from firstlight.bringup.signatures import packet


def propose(sig, ctx):
    op = getattr(sig, "op", "")
    if not op:
        return []
    scope = None if sig.kind == "op_not_lowered" else getattr(sig, "module", None)
    return [Candidate("host_fallback", (rule(op=packet(op), module=scope, fallback="host", why=sig.describe()),),
                      f"run {packet(op)} on the host" + (f" in {scope}" if scope else ""), cost_rank=3)]


register(Remedy("host_fallback", ("op_not_lowered", "op_class", "non_finite", "table_mismatch"), propose,
                cost="a host round trip per call: 2 x link latency + the op's tensors over the host link"))
