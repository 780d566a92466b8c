"""Build a table the target computes (rotary cos/sin) in fp32: on the device, or on the host as tt-metal does."""

from firstlight.bringup.remedies import Candidate, Remedy, register, rule

ROTARY = "rotary"  # the module that builds the rotary tables (models/layers.py RotaryTables)


def propose(sig, ctx):
    table = getattr(sig, "table", "") or ""
    if sig.kind == "table_mismatch" and "rope" not in table:
        return []
    why = sig.describe()
    out = []
    if ctx is None or ctx.site(ROTARY, "aten.cos").activation != "fp32":
        out.append(Candidate("recompute_table", (rule(module=ROTARY, activation="fp32", why=why),),
                             "build the rotary tables in fp32 on the device", cost_rank=0))
    return out + [Candidate("recompute_table", (rule(module=ROTARY, fallback="host", why=why),),
                            "build the rotary tables on the host (fp32)", cost_rank=1)]


register(Remedy("recompute_table", ("table_mismatch", "position_divergence"), propose,
                cost="once per forward: the table's size in fp32, or one host round trip", primary=("table_mismatch", "position_divergence")))
