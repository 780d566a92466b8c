"""When a bring-up is done: verify's own verdict, or thresholds on the quality metrics.

    --goal verdict                         verify says "match" (the default)
    --goal "ppl<=1.01,top1>=0.99,kl<=1e-3" every condition holds on the final verify

Metrics: `ppl` (target / reference perplexity; judged two-sided: |ratio - 1| <= bound - 1, since a
perplexity below the reference's is a mismatch too), `top1` (teacher-forced top-1 agreement),
`kl` (mean KL(reference || target), nats), `topk` (top-k overlap), `units` (isolated unit failures).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from firstlight.errors import FirstlightError

METRICS = ("ppl", "top1", "kl", "topk", "units")
_COND = re.compile(r"^\s*([a-z0-9]+)\s*(<=|>=|<|>|==)\s*([0-9.eE+-]+)\s*$")


class GoalError(FirstlightError):
    exit_code = 2


@dataclass(frozen=True)
class Condition:
    metric: str
    op: str
    bound: float

    def text(self) -> str:
        return f"{self.metric}{self.op}{self.bound:g}"


@dataclass(frozen=True)
class Goal:
    conditions: tuple[Condition, ...] = ()  # empty: verify's verdict

    @property
    def text(self) -> str:
        return ",".join(c.text() for c in self.conditions) or "verdict"

    def unmet(self, result: dict[str, Any]) -> list[str]:
        """What does not hold on a verify result (result.to_dict()); [] when the goal is met."""
        if not self.conditions:
            return [] if result.get("verdict") == "match" else list(result.get("reasons") or ["verdict mismatch"])
        values = metric_values(result)
        out = []
        for c in self.conditions:
            v = values.get(c.metric)
            if v is None:
                out.append(f"{c.metric}: not measured (run verify with perplexity / a continuation)")
            elif not _holds(c, v):
                out.append(f"{c.metric} = {v:.4g}, goal {c.text()}")
        return out


def _holds(c: Condition, v: float) -> bool:
    if c.metric == "ppl":  # two-sided: ppl<=1.01 means 0.99 <= ratio <= 1.01
        return abs(v - 1.0) <= abs(c.bound - 1.0) if c.op in ("<=", "<") else v >= c.bound
    return {"<=": v <= c.bound, "<": v < c.bound, ">=": v >= c.bound, ">": v > c.bound, "==": v == c.bound}[c.op]


def _finite(x: Any, worst: float) -> float:
    """verify reports a metric it could not compute (non-finite logits) as None or NaN: count it as the worst."""
    try:
        v = float(x)
    except (TypeError, ValueError):
        return worst
    return v if math.isfinite(v) else worst


def metric_values(result: dict[str, Any]) -> dict[str, float]:
    p = result.get("parity") or {}
    q = result.get("perplexity") or {}
    out: dict[str, float] = {}
    if "top1_agreement" in p:
        out["top1"] = _finite(p["top1_agreement"], 0.0)
        out["kl"] = max(_finite(p.get("mean_kl"), math.inf), 0.0)
        out["topk"] = _finite(p.get("topk_overlap"), 0.0)
    if "ratio" in q:
        out["ppl"] = _finite(q["ratio"], math.inf)
    out["units"] = float(sum(1 for b in result.get("boundaries", []) if not b.get("isolated", {}).get("ok", True)))
    return out


def parse_goal(text: str | None) -> Goal:
    """'verdict' / None / '' -> the verdict goal; 'ppl<=1.01,top1>=0.99' -> thresholds. Bad text: GoalError."""
    if text is None or text.strip() in ("", "verdict"):
        return Goal()
    conds = []
    for part in text.split(","):
        m = _COND.match(part)
        if not m:
            raise GoalError(f"goal '{text}': cannot parse '{part.strip()}'; write metric<=value joined by commas, "
                            f"e.g. 'ppl<=1.01,top1>=0.99,kl<=1e-3' (metrics: {', '.join(METRICS)}) or 'verdict'")
        metric, op, value = m.groups()
        if metric not in METRICS:
            raise GoalError(f"goal '{text}': unknown metric '{metric}'; known: {', '.join(METRICS)}")
        conds.append(Condition(metric, op, float(value)))
    return Goal(tuple(conds))
