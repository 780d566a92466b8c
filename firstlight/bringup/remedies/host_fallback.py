"""Run an op (or the whole module that holds it) on the host in fp32: always possible, never fast."""

from firstlight.bringup.remedies import Candidate, Remedy, register, rule
from firstlight.bringup.signatures import packet


def propose(sig, ctx):
    op = packet(getattr(sig, "op", ""))
    module = getattr(sig, "module", "") or None
    if not op:
        return []
    out = []
    if sig.kind == "op_not_lowered" and module and not module.startswith("layers."):
        # a whole table builder on the host, as tt-metal builds rotary tables: one fallback, not one per op
        out.append(Candidate("host_fallback", (rule(module=module, fallback="host", why=sig.describe()),),
                             f"run {module} on the host", cost_rank=3))
    scope = None if sig.kind == "op_not_lowered" else module
    out.append(Candidate("host_fallback", (rule(op=op, module=scope, fallback="host", why=sig.describe()),),
                         f"run {op} on the host" + (f" in {scope}" if scope else ""), cost_rank=3))
    return out


register(Remedy("host_fallback", ("op_not_lowered", "op_class", "non_finite", "table_mismatch"), propose,
                cost="a host round trip per call: 2 x link latency + the op's tensors over the host link", primary=("op_not_lowered",)))
