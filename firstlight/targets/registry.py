"""Targets found by name (`eager`, `inductor`, `onnxruntime`, `faulty`, `emulate`) or as `path/to/file.py:Class`.

A spec is `NAME`, `NAME:key=value,key=value` (options passed to the constructor as strings),
`emulate:CHIP[,overrides=FILE,seed=N]` or `path/to/file.py:ClassName` (a user target: a subclass of
`firstlight.targets.Target`; loading one runs its code, so load only files you trust).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from pathlib import Path

import torch

from firstlight.targets.base import Target, TargetError

# name -> "module:Class"; modules are imported on lookup so `import firstlight.targets` stays light.
BUILTIN: dict[str, str] = {
    "eager": "firstlight.targets.eager:EagerTarget",
    "inductor": "firstlight.targets.inductor:InductorTarget",
    "onnxruntime": "firstlight.targets.ort:OnnxRuntimeTarget",
    "faulty": "firstlight.targets.faulty:FaultyTarget",
    "emulate": "firstlight.targets.emulated:EmulatedTarget",
}


def target_names() -> list[str]:
    return sorted(BUILTIN)


def _parse_options(text: str, spec: str, positional: str | None = None) -> dict[str, str]:
    """`k=v,k=v`; with `positional`, a first part without '=' is that option (emulate:CHIP,k=v)."""
    options: dict[str, str] = {}
    for i, part in enumerate(filter(None, (p.strip() for p in text.split(",")))):
        if "=" not in part and i == 0 and positional:
            options[positional] = part
            continue
        if "=" not in part:
            raise TargetError(f"target spec '{spec}': option '{part}' is not key=value")
        key, value = part.split("=", 1)
        options[key.strip()] = value.strip()
    return options


def load_user_target(spec: str) -> type[Target]:
    """The Target subclass named by `path/to/file.py:ClassName`."""
    file_part, _, class_name = spec.rpartition(":")
    path = Path(file_part)
    if not path.is_file():
        raise TargetError(f"target file '{path}' not found (from --target {spec}); give path/to/file.py:ClassName")
    if not class_name:
        raise TargetError(f"target '{spec}' names no class; give path/to/file.py:ClassName")
    module_name = f"firstlight_user_target_{abs(hash(str(path.resolve())))}"
    loader_spec = importlib.util.spec_from_file_location(module_name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise TargetError(f"target file '{path}' cannot be imported as Python")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[module_name] = module
    try:
        loader_spec.loader.exec_module(module)
    except Exception as e:  # the user's code: any error means the same thing
        raise TargetError(f"target file '{path}' failed to import: {type(e).__name__}: {e}") from e
    cls = getattr(module, class_name, None)
    if cls is None:
        found = sorted(n for n, v in vars(module).items() if inspect.isclass(v) and issubclass(v, Target) and v is not Target)
        raise TargetError(
            f"target file '{path}' has no class '{class_name}'"
            + (f"; Target classes there: {', '.join(found)}" if found else "; it defines no Target subclass")
        )
    if not (inspect.isclass(cls) and issubclass(cls, Target)):
        raise TargetError(f"'{class_name}' in '{path}' is not a subclass of firstlight.targets.Target")
    return cls


def get_target(spec: str, dtype: torch.dtype = torch.float32) -> Target:
    """A constructed target for a spec (see module doc); errors name the spec and the choices."""
    if ".py:" in spec or spec.endswith(".py"):
        cls = load_user_target(spec)
        options: dict[str, str] = {}
    else:
        name, _, opts = spec.partition(":")
        if name not in BUILTIN:
            raise TargetError(f"unknown target '{name}'; built in: {', '.join(target_names())}, or path/to/file.py:ClassName")
        module_name, class_name = BUILTIN[name].split(":")
        cls = getattr(importlib.import_module(module_name), class_name)
        options = _parse_options(opts, spec, positional="chip" if name == "emulate" else None)
    try:
        return cls(dtype=dtype, **options)
    except TargetError:
        raise
    except TypeError as e:
        raise TargetError(f"target '{spec}': bad options ({e})") from e
