from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from firstlight.models.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", family="llama", seed=0)


@pytest.fixture(scope="session")
def tiny(tiny_ckpt: Path) -> tuple[Any, Any]:
    from firstlight.models.loader import load_model

    return load_model(tiny_ckpt)
