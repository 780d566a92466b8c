"""Targets: turn a model into something that runs (eager dtype, inductor, onnxruntime, emulated chips)."""

from firstlight.targets.base import OpSite, Target, TargetError, TargetReport

__all__ = ["OpSite", "Target", "TargetError", "TargetReport"]
