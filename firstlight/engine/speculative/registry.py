"""Proposers by name. Adding one is one module with a `@register` class, imported in `_load`."""

from __future__ import annotations

import importlib
from typing import Any

from firstlight.engine.speculative.base import Proposer
from firstlight.engine.speculative.config import SpecConfig
from firstlight.errors import FirstlightError

PROPOSERS: dict[str, type[Proposer]] = {}
_MODULES = ("ngram", "draft", "heads", "mtp")


def register(cls: type[Proposer]) -> type[Proposer]:
    PROPOSERS[cls.name] = cls
    return cls


def _load() -> None:
    for m in _MODULES:
        importlib.import_module(f"firstlight.engine.speculative.{m}")


def proposer_names() -> list[str]:
    _load()
    return sorted(PROPOSERS)


def make_proposer(cfg: SpecConfig, target: Any, tokenizer: Any = None) -> Proposer:
    """The proposer registered as cfg.method, built for `target` (a CausalLM) and its tokenizer."""
    _load()
    if cfg.method not in PROPOSERS:
        raise FirstlightError(f"speculative method '{cfg.method}' is unknown; choose one of: {', '.join(sorted(PROPOSERS))}")
    return PROPOSERS[cfg.method].from_config(cfg, target, tokenizer)
