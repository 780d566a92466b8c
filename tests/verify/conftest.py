from __future__ import annotations

from pathlib import Path

import pytest
import torch

from firstlight.models.tiny import TINY

FAMILIES = sorted(TINY)


@pytest.fixture(scope="session")
def tiny_dirs(tiny_checkpoint) -> dict[str, Path]:
    """One random-weight HF checkpoint dir per supported family (4 layers)."""
    return {f: tiny_checkpoint(f, seed=3) for f in FAMILIES}


@pytest.fixture(scope="session")
def references(tiny_dirs: dict[str, Path]):
    """HF reference models, loaded once per family on first use."""
    from firstlight.verify.harness import load_reference

    cache: dict[str, torch.nn.Module] = {}

    def get(family: str) -> torch.nn.Module:
        if family not in cache:
            cache[family] = load_reference(tiny_dirs[family])
        return cache[family]

    return get


@pytest.fixture(autouse=True)
def _reference_cache_in_tmp(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """`ContinuationCache.default()` (what `firstlight verify` uses) points into a fresh tmp dir, never
    the user's $FIRSTLIGHT_HOME (the slow tier still reads real models from there)."""
    from firstlight.verify import refcache

    root = tmp_path_factory.mktemp("verify-cache")
    monkeypatch.setattr(refcache, "default_cache_dir", lambda: root)
    return root
