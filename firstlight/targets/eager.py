"""`eager`: the model as PyTorch runs it, in any dtype. The baseline every other target is held to."""

from __future__ import annotations

from firstlight.targets.base import Target, TargetReport


class EagerTarget(Target):
    name = "eager"

    def report(self) -> TargetReport:
        rep = super().report()
        rep.notes.append("every op runs as a PyTorch eager kernel; nothing lowered, nothing falls back")
        return rep
