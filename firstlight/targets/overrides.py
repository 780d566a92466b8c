"""Per-op / per-module numerics overrides for the emulated chips: one YAML file, rules in order.

    chip: wormhole-n300            # optional: refuse the file on another chip
    rules:
      - module: "layers.*.mlp"     # glob on a module path; also matches everything inside it
        op: aten.mm                # glob on the ATen op ("aten.mm", "aten.exp", "*softmax*")
        matmul: {b_format: bfp8_b, fidelity: hifi2, accumulator: fp32}
        why: "accumulation error grows with K in down_proj"
      - module: norm
        activation: fp32           # the format this op's output is held in
      - op: aten.exp
        transcendental: exact      # an approximation name from firstlight.numerics.APPROX
      - op: aten.cos
        fallback: host             # run this op on the host in fp32 (priced as a round trip)
      - op: aten.gelu
        decompose: true            # run it as the lowered ops it is made of

A rule with neither `module` nor `op` applies everywhere (a chip-wide change). Later rules win.
The bring-up loop writes these files; `firstlight verify --overrides FILE` reads them. A rule that
names a module or op the model does not have is an error (TargetError, exit 2), never ignored.
"""

from __future__ import annotations

import fnmatch
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from firstlight.targets.base import TargetError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class MatmulOverride(_Strict):
    a_format: str | None = None
    b_format: str | None = None
    a_scaling: str | None = None
    b_scaling: str | None = None
    fidelity: str | None = None
    accumulator: str | None = None
    promotion_interval: int | None = Field(default=None, ge=1)
    rounding: Literal["rne", "stochastic", "truncate"] | None = None
    mma_k: int | None = Field(default=None, ge=1)

    def set_fields(self) -> dict[str, Any]:
        return self.model_dump(exclude_unset=True)


class OverrideRule(_Strict):
    module: str | None = None
    op: str | None = None
    activation: str | None = None
    matmul: MatmulOverride | None = None
    transcendental: str | None = None
    fallback: Literal["host"] | None = None
    decompose: bool | None = None
    why: str = ""

    def matches(self, module: str, op: str) -> bool:
        if self.op is not None and not op_matches(self.op, op):
            return False
        return self.module is None or module_matches(self.module, module)

    def describe(self) -> str:
        where = " ".join(f"{k}={v}" for k, v in (("module", self.module), ("op", self.op)) if v) or "everywhere"
        what = self.model_dump(exclude_none=True, exclude={"module", "op", "why"})
        return f"{where}: {what}"


class Overrides(_Strict):
    chip: str | None = None
    rules: list[OverrideRule] = Field(default_factory=list)

    def plus(self, *rules: OverrideRule) -> Overrides:
        return Overrides(chip=self.chip, rules=[*self.rules, *rules])

    def without(self, index: int) -> Overrides:
        return Overrides(chip=self.chip, rules=[r for i, r in enumerate(self.rules) if i != index])

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(exclude_none=True, exclude_defaults=False), sort_keys=False)


def op_matches(pattern: str, op: str) -> bool:
    """`aten.mm` matches 'aten.mm.default' and its packet 'aten.mm'; globs allowed."""
    packet = op.rsplit(".", 1)[0] if op.count(".") >= 2 else op
    return any(fnmatch.fnmatchcase(n, pattern) for n in (op, packet))


def module_matches(pattern: str, module: str) -> bool:
    """The glob matches the module path or one of its ancestors (a rule on a module covers its inside)."""
    parts = module.split(".") if module else [""]
    return any(fnmatch.fnmatchcase(".".join(parts[:i]), pattern) for i in range(len(parts), 0, -1))


def load_overrides(path: str | Path) -> Overrides:
    """Read and validate an overrides file; errors name the file and the key."""
    p = Path(path)
    if not p.is_file():
        raise TargetError(f"overrides file '{p}' not found; give a YAML file (docs/EMULATION.md, 'Overrides')")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise TargetError(f"overrides file '{p}' is not valid YAML: {e}") from None
    return overrides_from_dict(data if data is not None else {}, str(p))


def overrides_from_dict(data: Any, where: str = "<overrides>") -> Overrides:
    if not isinstance(data, dict):
        raise TargetError(f"overrides {where} must be a YAML mapping with a 'rules' list, got {type(data).__name__}")
    try:
        return Overrides.model_validate(data)
    except ValidationError as e:
        parts = []
        for err in e.errors():
            loc = ".".join(str(x) for x in err["loc"]) or "<top level>"
            parts.append(f"{loc}: {'unknown key' if err['type'] == 'extra_forbidden' else err['msg']}")
        raise TargetError(f"overrides {where} is invalid: " + "; ".join(parts)) from None
