"""Shared data objects: what engine, bench and sim exchange without importing each other.

Nothing here imports torch.
"""

from firstlight.core.batch import Batch, ScheduledSeq
from firstlight.core.trace import StepRecord, Trace

__all__ = ["Batch", "ScheduledSeq", "StepRecord", "Trace"]
