from __future__ import annotations

from pathlib import Path

import pytest
import torch

from firstlight.models.tiny import TINY, write_tiny_checkpoint

FAMILIES = sorted(TINY)


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One random-weight HF checkpoint dir per supported family."""
    root = tmp_path_factory.mktemp("tiny")
    return {f: write_tiny_checkpoint(root / f, f, seed=1) for f in FAMILIES}
