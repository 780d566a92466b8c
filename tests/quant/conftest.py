from __future__ import annotations

from pathlib import Path

import pytest
import torch

from firstlight.models.tiny import write_tiny_checkpoint


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Random-weight checkpoints: llama (untied head, biases) and qwen2 (tied head)."""
    root = tmp_path_factory.mktemp("tiny_quant")
    return {f: write_tiny_checkpoint(root / f, f, seed=3) for f in ("llama", "qwen2")}
