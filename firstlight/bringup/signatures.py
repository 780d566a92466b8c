"""Failure signatures: what kind of failure verify found, computed from its evidence.

Each signature is a small frozen dataclass: testable on its own, written to the runbook, and keyed
into the playbook by `key()` (its kind plus the class of what failed, not the layer index, so a
remedy learned on one layer, model or chip is tried first on the next):

    OpNotLowered       the chip's compiler lacks an op                      (compile error)
    NonFinite          inf / NaN appears; the first op that makes one
    Accumulation       a matmul whose error grows with its reduction length (narrow accumulator)
    OpClassError       error concentrated in one op class: matmul, softmax, norm, transcendental, ...
    TableMismatch      a table the target builds (rotary cos/sin, mask, scales) differs from the reference's
    DecodeOnly         the full forward matches; a serving path (decode steps or chunked prefill through
                       the paged KV cache) differs from the target's own full forward, or its cached K/V
                       from the reference's. A path step that agrees with the target's own full forward
                       and still misses the reference is the model's numerics on that row: QualityOnly
                       (or the op class of the culprit verify replayed), not a path failure.
    PositionDivergence only late positions / long-range checks fail
    UnitComposition    a unit fails but no single op does (fusion / reordering / compound rounding)
    QualityOnly        every unit passes, an end-to-end quality metric does not
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from firstlight.targets.base import OpNotLoweredError

MATMUL_OPS = ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten.linear", "aten.matmul")
TRANSCENDENTAL_OPS = ("aten.exp", "aten.reciprocal", "aten.rsqrt", "aten.sqrt", "aten.gelu", "aten.silu",
                      "aten.sigmoid", "aten.tanh", "aten.log")
NARROW_ACCUMULATORS = ("bf16", "fp16", "fp22", "tf32")
_LAYER = re.compile(r"(^|\.)layers\.\d+(\.|$)")


def packet(op: str) -> str:
    return op.rsplit(".", 1)[0] if op.count(".") >= 2 else op


def op_class(op: str, module: str = "") -> str:
    """matmul | softmax | norm | transcendental | embedding | elementwise."""
    p = packet(op)
    if p in MATMUL_OPS:
        return "matmul"
    if "softmax" in p:
        return "softmax"
    if module.rsplit(".", 1)[-1].endswith("norm") or p == "aten.rsqrt":
        return "norm"
    if p in TRANSCENDENTAL_OPS:
        return "transcendental"
    if p == "aten.embedding":
        return "embedding"
    return "elementwise"


def module_kind(module: str) -> str:
    """The module path with its layer index wildcarded: a remedy's natural scope."""
    return _LAYER.sub(lambda m: f"{m.group(1)}layers.*{m.group(2)}", module)


@dataclass(frozen=True)
class Signature:
    kind: ClassVar[str] = "signature"

    def key(self) -> str:
        return self.kind

    def describe(self) -> str:
        fields = ", ".join(f"{k}={v}" for k, v in asdict(self).items() if v not in (None, "", ()) and k != "evidence")
        return f"{self.kind}({fields})"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "key": self.key(), **asdict(self)}


@dataclass(frozen=True)
class OpNotLowered(Signature):
    kind: ClassVar[str] = "op_not_lowered"
    op: str = ""
    module: str = ""
    line: str | None = None

    def key(self) -> str:
        return f"{self.kind}:{packet(self.op)}"


@dataclass(frozen=True)
class NonFinite(Signature):
    kind: ClassVar[str] = "non_finite"
    op: str = ""
    module: str = ""

    def key(self) -> str:
        return f"{self.kind}:{op_class(self.op, self.module)}"


@dataclass(frozen=True)
class Accumulation(Signature):
    kind: ClassVar[str] = "accumulation"
    op: str = ""
    module: str = ""
    reduction_len: int | None = None
    accumulator: str = ""
    growth: float | None = None  # rank correlation of error with K over the unit's matmuls

    def key(self) -> str:
        return f"{self.kind}:{self.accumulator}"


@dataclass(frozen=True)
class OpClassError(Signature):
    kind: ClassVar[str] = "op_class"
    op_class: str = ""
    op: str = ""
    module: str = ""
    rel_l2: float | None = None

    def key(self) -> str:
        return f"{self.kind}:{self.op_class}"


@dataclass(frozen=True)
class WeightMismatch(Signature):
    """The failing unit's parameters differ from the reference's (verify's weight check): the checkpoint
    was loaded or converted wrong. No override remedies it; the loop stops and says so."""

    kind: ClassVar[str] = "weight_mismatch"
    param: str = ""
    module: str = ""


@dataclass(frozen=True)
class TableMismatch(Signature):
    kind: ClassVar[str] = "table_mismatch"
    table: str = ""
    op: str = ""

    def key(self) -> str:
        return f"{self.kind}:{self.table.split(':')[0]}"


@dataclass(frozen=True)
class DecodeOnly(Signature):
    kind: ClassVar[str] = "decode_only"
    path: str = ""
    step: int | None = None
    phase: str = ""  # "decode" | "prefill" (a chunk through the cache) | "cache" (only the cached K/V differ)
    unit: str = ""  # the step's first unit over tolerance on the reference's inputs ("" when none is)
    op: str = ""
    module: str = ""

    def key(self) -> str:
        what = op_class(self.op, self.module) if self.op else "cache" if self.phase == "cache" or not self.unit \
            else "unit"
        return f"{self.kind}:{what}"


@dataclass(frozen=True)
class PositionDivergence(Signature):
    kind: ClassVar[str] = "position_divergence"
    position: int | None = None
    unit: str = ""


@dataclass(frozen=True)
class UnitComposition(Signature):
    kind: ClassVar[str] = "unit_composition"
    unit: str = ""
    module: str = ""  # the op with the largest isolated error in the unit's replay: where remedies aim
    op: str = ""

    def key(self) -> str:
        return f"{self.kind}:{module_kind(self.unit).split('.')[0]}"


@dataclass(frozen=True)
class QualityOnly(Signature):
    kind: ClassVar[str] = "quality_only"
    metric: str = ""
    reasons: tuple[str, ...] = field(default_factory=tuple)

    def key(self) -> str:
        return f"{self.kind}:{self.metric}"


@dataclass
class Context:
    """What classification needs beyond the result: the target's numerics at a site, a matmul's K."""

    accumulator: Callable[[str, str], str] = lambda module, op: "fp32"
    reduction_len: Callable[[str], int | None] = lambda module: None


def classify(result: dict[str, Any] | None, error: Exception | None = None, ctx: Context | None = None) -> Signature:
    """The signature of one failed verify (`result.to_dict()`), or of the error that stopped it."""
    ctx = ctx or Context()
    if isinstance(error, OpNotLoweredError):
        return OpNotLowered(op=error.op, module=error.module, line=error.line)
    if error is not None:
        raise error
    assert result is not None
    for finder in (_non_finite, _table, _path_failure, _unit_failure, _late_positions):
        sig = finder(result, ctx)
        if sig is not None:
            return sig
    reasons = tuple(result.get("reasons") or ())
    metric = "ppl" if any("perplexity" in r for r in reasons) else "kl" if any("KL" in r for r in reasons) else "top1"
    return QualityOnly(metric=metric, reasons=reasons)


def _bad(m: dict[str, Any] | None) -> bool:
    return m is not None and any(isinstance(v, float) and not math.isfinite(v) for v in m.values())


def _non_finite(result: dict[str, Any], ctx: Context) -> Signature | None:
    nf = result.get("non_finite") or result.get("first_non_finite")
    if isinstance(nf, dict) and nf:
        return NonFinite(op=str(nf.get("op", "")), module=str(nf.get("module", nf.get("unit", ""))))
    for r in result.get("ops") or []:
        if _bad(r.get("isolated")):
            return NonFinite(op=r["op"], module=r["module"])
    return None


def _table(result: dict[str, Any], ctx: Context) -> Signature | None:
    for t in result.get("tables") or []:
        if not t.get("ok", True):
            return TableMismatch(table=str(t.get("name", "")), op=str(t.get("op", "")))
    first = result.get("first_failing") or {}
    if first.get("unit") == "tables":  # a table a serving path's step built
        return TableMismatch(table=str(first.get("table") or ""))
    return None


def _unit_failure(result: dict[str, Any], ctx: Context) -> Signature | None:
    first = result.get("first_failing")
    if not first:
        return None
    return _op_signature(result, first, ctx)


def _op_signature(result: dict[str, Any], first: dict[str, Any], ctx: Context) -> Signature:
    """From the failing unit's op replay: the culprit's class (or accumulation), else unit composition."""
    c = result.get("culprit")
    if c is None:  # every op within tolerance alone: aim at the one closest to failing
        worst = max((r for r in result.get("ops") or [] if math.isfinite(r["isolated"].get("rel_l2", 0.0))),
                    key=lambda r: r["isolated"].get("rel_l2", 0.0), default=None)
        prop = worst or first.get("first_propagated_op") or {}
        # verify may give None for what it could not name (a unit of a serving path, an op outside modules)
        return UnitComposition(unit=first.get("unit") or "", module=prop.get("module") or "", op=prop.get("op") or "")
    op, module = c["op"] or "", c["module"] or ""
    if op == "weight":  # verify found our weights differ from the reference's: a loader bug, no numerics knob
        return WeightMismatch(param=str(c.get("param", "")), module=module)
    cls = op_class(op, module)
    if cls == "matmul":
        acc = ctx.accumulator(module, packet(op))
        if acc in NARROW_ACCUMULATORS:
            growth = _growth_with_k(result.get("ops") or [], ctx)
            k = ctx.reduction_len(module)
            if (growth is not None and growth > 0.3) or (k or 0) >= 256:
                return Accumulation(op=op, module=module, reduction_len=k, accumulator=acc, growth=growth)
    return OpClassError(op_class=cls, op=op, module=module, rel_l2=c.get("isolated", {}).get("rel_l2"))


def _growth_with_k(records: list[dict[str, Any]], ctx: Context) -> float | None:
    """Spearman rank correlation between a weight matmul's K and its isolated error, over one unit."""
    pts = [(k, r["isolated"]["rel_l2"]) for r in records if packet(r["op"]) in MATMUL_OPS
           and (k := ctx.reduction_len(r["module"])) is not None and math.isfinite(r["isolated"]["rel_l2"])]
    if len(pts) < 3 or len({k for k, _ in pts}) < 2:
        return None

    def ranks(xs: list[float]) -> list[float]:
        order = sorted(range(len(xs)), key=lambda i: xs[i])
        r = [0.0] * len(xs)
        for pos, i in enumerate(order):
            r[i] = float(pos)
        return r

    rk, re_ = ranks([k for k, _ in pts]), ranks([e for _, e in pts])
    n = len(pts)
    mk, me = sum(rk) / n, sum(re_) / n
    cov = sum((a - mk) * (b - me) for a, b in zip(rk, re_, strict=True))
    var = math.sqrt(sum((a - mk) ** 2 for a in rk) * sum((b - me) ** 2 for b in re_))
    return cov / var if var else None


def _path_failure(result: dict[str, Any], ctx: Context) -> Signature | None:
    """A serving path fails while the full forward's units pass (verify localizes a path only then)."""
    first = result.get("first_failing") or {}
    if first and not first.get("path"):
        return None  # a unit of the full forward fails: that is the evidence to act on
    name, rec = next(((n, r) for n, r in (result.get("paths") or {}).items() if not r.get("ok", True)), (None, None))
    if rec is None:
        return None
    k = rec.get("first_failing_step")
    if k is None:  # every step's logits pass; the K/V the target cached do not
        bad = (rec.get("kv_cache") or {}).get("first_bad") or {}
        layer = bad.get("layer")
        return DecodeOnly(path=name, phase="cache", unit="" if layer is None else f"layers.{layer}")
    step = rec["steps"][k]
    own = step.get("vs_full_forward") or {}
    unit = first.get("unit") or ""
    if own.get("ok", False):
        # the step agrees with the target's own full forward of its row: no path bug, the model's
        # numerics miss on this row's input; act on the op verify replayed there, if it named one
        if result.get("culprit") and unit:
            return _op_signature(result, first, ctx)
        reasons = tuple(r for r in result.get("reasons") or () if r.startswith(f"{name} path"))
        return QualityOnly(metric="kl", reasons=reasons)
    c = result.get("culprit") or {}
    return DecodeOnly(path=name, step=k, phase=str(step.get("phase", "")), unit=unit,
                      op=str(c.get("op") or ""), module=str(c.get("module") or ""))


def _late_positions(result: dict[str, Any], ctx: Context) -> Signature | None:
    """Only the long-range check (perplexity windows) fails; verify's long-range pass says from where."""
    lr = result.get("long_range") or {}
    if lr.get("first_position") is not None:
        return PositionDivergence(position=int(lr["first_position"]), unit=str(lr.get("first_unit") or ""))
    div = (result.get("perplexity") or {}).get("first_divergence") or {}
    if div.get("position") is not None and not result.get("first_failing"):
        return PositionDivergence(position=int(div["position"]))
    return None
