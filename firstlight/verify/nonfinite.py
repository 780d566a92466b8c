"""Where the first NaN or inf appears, and results that stay valid JSON when values are not finite.

A non-finite value poisons everything after it, so the useful fact is where it is born: the first
boundary in model order whose target tensor holds a NaN/inf where the reference's is finite
(`TensorMetrics.nonfinite`), and, from the op replay of that unit, the first op whose output does.
Serving paths, tables, parity and perplexity are searched after the full-sequence units.
"""

from __future__ import annotations

import math
from typing import Any


def json_safe(obj: Any) -> Any:
    """`obj` with every non-finite float replaced by None (strict JSON has no NaN / Infinity)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def _nf(m: dict[str, Any] | None) -> int:
    return int((m or {}).get("nonfinite") or 0)


def _first_op(ops: list[dict[str, Any]]) -> dict[str, Any] | None:
    for mode in ("isolated", "propagated"):  # born in an op (isolated) before inherited (propagated)
        for o in ops:
            if _nf(o.get(mode)):
                return {"op": o["op"], "module": o["module"], "source": o.get("source"), "code": o.get("code"),
                        "op_index": o["index"], "op_mode": mode}
    return None


def first_nonfinite(result: Any) -> dict[str, Any] | None:
    """{'where', 'unit', 'boundary', 'mode', 'op', 'module', 'source', ...} or None if every value is finite."""
    for b in result.boundaries:
        for mode in ("propagated", "isolated"):
            if _nf(b.get(mode)):
                unit = ".".join(b["name"].split(".")[:2]) if b["name"].startswith("layers.") else b["name"]
                out: dict[str, Any] = {"where": f"boundary {b['name']} ({mode})", "unit": unit, "boundary": b["name"],
                                       "mode": mode, "count": _nf(b.get(mode)), "op": None}
                ff = result.first_failing or {}
                if ff.get("unit") == unit and ff.get("path") is None:
                    out.update(_first_op(result.ops) or {})
                return out
    for row in result.tables or []:
        if _nf(row):
            return {"where": f"table {row['name']} ({row['path']})", "unit": "tables", "boundary": row["name"],
                    "count": _nf(row), "op": None}
    for name, rec in (result.paths or {}).items():
        for st in rec["steps"]:
            if st.get("nonfinite_rows"):
                out = {"where": f"{name} path, step {st['step']} ({st['phase']}) logits", "unit": None,
                       "path": name, "step": st["step"], "count": st["nonfinite_rows"], "op": None}
                for u in (rec.get("localization") or {}).get("units", []):
                    if any(_nf(u.get(k)) for k in ("output", "k", "v", "logits")):
                        out["unit"] = u["unit"]
                        ff = result.first_failing or {}
                        if ff.get("path") == name and ff.get("unit") == u["unit"]:
                            out.update(_first_op(result.ops) or {})
                        break
                return out
    p = result.parity or {}
    if p.get("nonfinite_positions"):
        return {"where": "logits of the whole-model unit", "unit": "logits", "count": p["nonfinite_positions"], "op": None}
    q = result.perplexity or {}
    if q and q.get("direction") == "non-finite":
        return {"where": "perplexity windows (logits unit)", "unit": "logits", "op": None}
    return None
