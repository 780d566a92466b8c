from __future__ import annotations

from pathlib import Path

import pytest

from firstlight.models.tiny import TINY

FAMILIES = sorted(TINY)


@pytest.fixture(scope="session")
def tiny_dirs(tiny_checkpoint) -> dict[str, Path]:
    """One random-weight HF checkpoint dir per supported family."""
    return {f: tiny_checkpoint(f, seed=1) for f in FAMILIES}
