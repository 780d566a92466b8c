"""Build a table the target computes (rotary cos/sin, masks, scales) in fp32 instead of the activation format."""

from firstlight.bringup.remedies import Candidate, Remedy, register, rule
from firstlight.bringup.signatures import packet


def propose(sig, ctx):
    ops = (packet(sig.op),) if getattr(sig, "op", "") else ("aten.cos", "aten.sin")
    return [Candidate("recompute_table", tuple(rule(op=o, activation="fp32", why=sig.describe()) for o in ops),
                      f"recompute {sig.table or 'the table'} in fp32 ({', '.join(ops)})", cost_rank=0)]


register(Remedy("recompute_table", ("table_mismatch", "position_divergence"), propose,
                cost="once per forward: the table's size in fp32"))
