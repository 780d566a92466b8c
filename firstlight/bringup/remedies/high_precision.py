"""Keep the sensitive modules in fp32: embedding, LM head, norms, softmax, router; the attention
(and so the K/V it caches) when only a serving path fails."""

from firstlight.bringup.remedies import Candidate, Remedy, matmul_rules, register, rule, scope_of
from firstlight.bringup.signatures import op_class

SENSITIVE = ("embed_tokens", "lm_head", "norm", "router", "gate")


def propose(sig, ctx):
    module = getattr(sig, "module", "") or getattr(sig, "unit", "")
    op = getattr(sig, "op", "")
    cls = op_class(op, module) if op else ""
    scope = scope_of(sig, ctx)
    # a serving-path failure: its scope is the attention, which reads and writes the KV cache
    if not scope or not (cls in ("norm", "softmax", "embedding") or scope.rsplit(".", 1)[-1].endswith(SENSITIVE)
                         or sig.kind == "decode_only"):
        return []
    mm = {"a_format": "bf16", "b_format": "bf16", "accumulator": "fp32", "a_scaling": None, "b_scaling": None}
    rules = (rule(module=scope, activation="fp32", why=sig.describe()),) + (
        matmul_rules(scope, None, sig.describe(), **mm) if "lm_head" in scope else ())
    return [Candidate("high_precision", rules, f"keep {scope} in fp32", cost_rank=1)]


register(Remedy("high_precision", ("op_class", "unit_composition", "non_finite", "quality_only", "decode_only"), propose,
                cost="that module's tensors twice as wide: small for norms and softmax, the LM head's bytes for the head; "
                     "for the attention, the K/V it caches", primary=("op_class", "non_finite", "decode_only")))
