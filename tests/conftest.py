"""Fixtures shared by every test area: one torch thread, and tiny random checkpoints made once."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`tiny_checkpoint(family, seed=0)`: a random-weight HF checkpoint dir, written once per session."""
    from firstlight.models.tiny import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("tiny")
    made: dict[tuple[str, int], Path] = {}

    def make(family: str, seed: int = 0) -> Path:
        if (family, seed) not in made:
            made[family, seed] = write_tiny_checkpoint(root / f"{family}-{seed}", family, seed=seed)
        return made[family, seed]

    return make
