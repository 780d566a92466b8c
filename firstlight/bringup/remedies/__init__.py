"""Remedies: plain functions that turn a failure signature into override rules, registered by name.

A remedy is one file in this package (or a user file, `firstlight bringup --remedies FILE.py`) that
calls `register(Remedy(...))`. `propose(signature, ctx)` returns candidates (rules to append to the
overrides, most specific first); `cheaper(candidate, ctx)` returns cheaper variants of an applied
candidate for the performance phase, closest first (each cheaper, and less accurate, than the one
before: the phase walks down until one fails the goal). `cost` says what the remedy costs on a chip;
the loop also measures it as the change in the spec-predicted time.
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from firstlight.bringup.signatures import Signature
from firstlight.core.hardware import NumericsSpec
from firstlight.errors import FirstlightError
from firstlight.targets.overrides import OverrideRule


@dataclass(frozen=True)
class Candidate:
    remedy: str
    rules: tuple[OverrideRule, ...]
    description: str
    cost_rank: int = 1  # 0 free .. 3 expensive: the order when the playbook knows nothing
    primary: bool = False  # the remedy is the direct answer to the signature's kind (set by `candidates`)

    @property
    def key(self) -> str:
        return f"{self.remedy}:" + "|".join(r.model_dump_json(exclude_none=True, exclude={"why"}) for r in self.rules)

    def to_dict(self) -> dict[str, Any]:
        return {"remedy": self.remedy, "description": self.description,
                "rules": [r.model_dump(exclude_none=True) for r in self.rules]}


@dataclass
class RemedyContext:
    """What a remedy may look at: the chip's numerics, the numerics in force at a site, the model's modules."""

    numerics: NumericsSpec
    site: Callable[[str, str], Any]  # (module, op packet) -> targets.emulated_ops.SiteNumerics
    modules: list[str] = field(default_factory=list)


Propose = Callable[[Signature, RemedyContext], list[Candidate]]
Cheaper = Callable[[Candidate, RemedyContext], list[Candidate]]


@dataclass(frozen=True)
class Remedy:
    name: str
    kinds: tuple[str, ...]  # signature kinds it answers
    propose: Propose
    cost: str  # the known cost, in words (runbook and docs)
    cheaper: Cheaper | None = None
    # the kinds it is the direct answer to (an accumulation error -> a wider accumulator), tried before
    # the remedies that answer the kind only as a side effect (a higher fidelity, an upcast module)
    primary: tuple[str, ...] = ()


REGISTRY: dict[str, Remedy] = {}


def register(remedy: Remedy) -> Remedy:
    REGISTRY[remedy.name] = remedy
    return remedy


def load_builtin() -> dict[str, Remedy]:
    for info in pkgutil.iter_modules(__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}")
    return REGISTRY


def load_file(path: str | Path) -> list[str]:
    """Import a user remedy file (it runs its code: load only files you trust); the names it registered."""
    p = Path(path)
    if not p.is_file():
        raise FirstlightError(f"remedy file '{p}' not found; give a .py file that calls "
                              "firstlight.bringup.remedies.register(Remedy(...))")
    before = set(REGISTRY)
    spec = importlib.util.spec_from_file_location(f"firstlight_user_remedy_{abs(hash(str(p.resolve())))}", p)
    if spec is None or spec.loader is None:
        raise FirstlightError(f"remedy file '{p}' cannot be imported as Python")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # the user's code: any error means the same thing
        raise FirstlightError(f"remedy file '{p}' failed to import: {type(e).__name__}: {e}") from e
    added = sorted(set(REGISTRY) - before)
    if not added:
        raise FirstlightError(f"remedy file '{p}' registered no remedy; call register(Remedy(...)) in it")
    return added


def candidates(sig: Signature, ctx: RemedyContext) -> list[Candidate]:
    """Every registered remedy's candidates for `sig`, in registry order."""
    out: list[Candidate] = []
    for r in load_builtin().values():
        if sig.kind in r.kinds:
            out.extend(replace(c, primary=sig.kind in r.primary) for c in r.propose(sig, ctx))
    return out


def rule(**kw: Any) -> OverrideRule:
    return OverrideRule(**{k: v for k, v in kw.items() if v is not None})


def matmul_rules(scope: str | None, op: str | None, why: str, **matmul: Any) -> tuple[OverrideRule, ...]:
    """Rules setting `matmul` fields: on every matmul inside `scope` (a Linear runs one), or, with no
    scope, on `op` everywhere; with neither, on the weight matmuls (aten.mm and aten.addmm) everywhere."""
    if scope is not None:
        return (rule(module=scope, matmul=matmul, why=why),)
    ops = (op,) if op else ("aten.mm", "aten.addmm")
    return tuple(rule(op=o, matmul=matmul, why=why) for o in ops)


def scope_of(sig: Signature, ctx: RemedyContext | None = None) -> str | None:
    """The module scope a remedy for `sig` covers: the failing module in every layer. A serving-path
    failure verify could not pin on a unit (the cached K/V, a decode step whose units all pass on the
    reference's inputs) is scoped to the attention, the modules that read and write the cache."""
    from firstlight.bringup.signatures import module_kind

    module = getattr(sig, "module", "")
    if not module and sig.kind == "decode_only" and ctx is not None:
        module = next((m for m in ctx.modules if _ATTENTION.search(m)), "")
    module = module or getattr(sig, "unit", "")
    return module_kind(module) if module else None


_ATTENTION = re.compile(r"(^|\.)layers\.\d+\.(self_attn|attn|attention)$")
