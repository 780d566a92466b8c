"""The dependency rules of docs/ARCHITECTURE.md, checked by walking every module's imports."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "firstlight"

# package -> packages it must never import (directly, at any depth of its own modules)
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "models": ("engine", "bench", "sim", "verify", "bringup"),
    "quant": ("engine", "bench", "sim", "verify", "bringup"),
    "verify": ("engine", "bench", "sim"),
    "eval": ("engine", "bench", "sim"),
    "targets": ("engine", "bench", "verify", "bringup"),
    "bench": ("engine", "models", "sim", "verify", "targets"),
    "sim": ("engine", "models", "verify", "targets", "bench"),
    "numerics": ("engine", "bench", "sim", "verify", "targets", "bringup", "models", "quant", "eval", "train"),
    "core": ("engine", "models", "verify", "targets", "bench", "sim", "quant", "bringup", "eval", "train"),
}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_does_not_import_upper_layers(package: str) -> None:
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for name in imported_modules(path):
            parts = name.split(".")
            if parts[0] == "firstlight" and len(parts) > 1 and parts[1] in FORBIDDEN[package]:
                bad.append(f"{path.relative_to(ROOT.parent)} imports {name}")
    assert not bad, "\n".join(bad)


def test_scheduler_imports_no_torch() -> None:
    assert not any(n == "torch" or n.startswith("torch.") for n in imported_modules(ROOT / "engine" / "scheduler.py"))
