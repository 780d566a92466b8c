"""Planners pick which remedy the loop tries next. The default ranks by the playbook's evidence.

A planner is any object with `rank(signature, candidates, info) -> candidates in trial order`.
`PlaybookPlanner` orders by past success for similar signatures (same signature key first, then
same kind; the same chip, vendor and model family weigh more), then by fit (a remedy that directly answers
the signature's kind, e.g. a wider accumulator for an accumulation error, before one that helps only as
a side effect, e.g. a higher fidelity or an upcast module), then by scope (a local failure tries the
failing module first, a widespread one the whole model), then by the remedy's cost rank and registry
order, so with an empty playbook the cheapest direct remedy goes first.

Scope escalates: a remedy already kept for one module and proposed again for another is no longer a
local answer, so its model-wide variant goes before the next module's (SmolLM2 on H100 took bf16
weights in o_proj, then down_proj, then qkv_proj, one verify run each).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from firstlight.bringup.playbook import Playbook
from firstlight.bringup.remedies import Candidate
from firstlight.bringup.signatures import Signature
from firstlight.targets.overrides import OverrideRule


@dataclass(frozen=True)
class RunInfo:
    chip: str
    vendor: str
    family: str
    model: str


class Planner(Protocol):
    def rank(self, sig: Signature, candidates: list[Candidate], info: RunInfo, spread: float = 0.0,
             kept: Sequence[Candidate] = ()) -> list[Candidate]:
        """Candidates in trial order; `spread` is the fraction of verify's units that fail (0..1), `kept`
        the remedies the configuration holds."""
        ...


def scoped(c: Candidate) -> bool:
    return any(r.module is not None for r in c.rules)


def widens(wide: Candidate, kept: Candidate) -> bool:
    """Whether `wide` is `kept` (a module-scoped candidate) applied to the whole model: the same remedy,
    and every rule of `kept` set, without its module, by a rule of `wide` (on the same op, when `kept`
    names one and `wide` does too: exact SiLU in the MLP does not make exact exp everywhere its widening)."""
    if wide.remedy != kept.remedy or scoped(wide) or not scoped(kept):
        return False

    def what(r: OverrideRule) -> str:
        return r.model_dump_json(exclude_none=True, exclude={"module", "op", "why"})

    return all(any(what(w) == what(k) and (None in (k.op, w.op) or k.op == w.op) for w in wide.rules)
               for k in kept.rules)


class PlaybookPlanner:
    def __init__(self, playbook: Playbook) -> None:
        self.playbook = playbook

    def rank(self, sig: Signature, candidates: list[Candidate], info: RunInfo, spread: float = 0.0,
             kept: Sequence[Candidate] = ()) -> list[Candidate]:
        """Playbook score first, then direct remedies before side-effect ones, then the model-wide
        variant of a remedy already kept for another module (escalation); when most units fail
        (spread > 0.5) the failure is not local, so model-wide candidates go before ones scoped to the
        failing module; then cost rank, then registry order."""
        def key(ic: tuple[int, Candidate]) -> tuple[float, int, int, int, int, int]:
            i, c = ic
            score = self.playbook.score(c.remedy, sig.key(), sig.kind, info.chip, info.vendor, info.family)
            local = scoped(c)
            wide = int(not any(widens(c, k) for k in kept))
            return (-score, int(not c.primary), wide, int(local) if spread > 0.5 else int(not local), c.cost_rank, i)

        return [c for _, c in sorted(enumerate(candidates), key=key)]
