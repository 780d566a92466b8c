"""`inductor`: torch.compile with the Inductor backend (C++/OpenMP on CPU, Triton on GPU).

One compiled artifact per unit key (`logits`, `embed`, `layer:<type>`, `head`): parameters are
inputs, so every layer of a type shares one compile. Reports the FX ops Dynamo handed Inductor
and Dynamo's graph breaks (ops that fell back to Python).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from firstlight.targets.base import Target, TargetError, TargetReport

_MAX_UNITS = 256  # compiled units per process (Dynamo's recompile limit while compiling one)


class InductorTarget(Target):
    name = "inductor"
    supports_hooks = False

    def __init__(self, dtype: torch.dtype = torch.float32, mode: str = "default", **options: str) -> None:
        super().__init__(dtype, **options)
        self.mode = mode
        self._cache: dict[tuple[str, tuple], Callable[..., Any]] = {}
        self._ops: Counter[str] = Counter()
        self._graphs = 0

    def _backend(self, gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable[..., Any]:
        from torch._inductor.compile_fx import compile_fx

        self._graphs += 1
        for node in gm.graph.nodes:
            if node.op in ("call_function", "call_method"):
                self._ops[getattr(node.target, "__name__", str(node.target))] += 1
        return compile_fx(gm, example_inputs)

    def compile(self, unit: nn.Module, example_inputs: Sequence[torch.Tensor], key: str) -> Callable[..., Any]:
        shapes = tuple((tuple(t.shape), t.dtype) for t in example_inputs)
        if (key, shapes) not in self._cache:
            fn = torch.compile(unit, backend=self._backend, dynamic=False, fullgraph=False)
            graphs = self._graphs
            # Every unit runs the same `Unit.forward` code object, and Dynamo counts each unit's
            # compile as a recompile of it: past its limit (8) it marks the code to run eagerly
            # from then on, and the verification would pass on eager numbers. Raise the limit
            # while compiling and running, and check that Inductor really got a graph.
            with torch._dynamo.config.patch(recompile_limit=_MAX_UNITS, accumulated_recompile_limit=4 * _MAX_UNITS):
                fn(*example_inputs)  # compile now, so a compile error is reported as one
            if self._graphs == graphs:
                raise TargetError(f"inductor: Dynamo compiled no graph for unit '{key}' (it ran eagerly); "
                                  "run with TORCH_LOGS=recompiles to see why")
            self._cache[(key, shapes)] = fn
        fn = self._cache[(key, shapes)]

        def run(*xs: torch.Tensor) -> Any:
            # a guard that fails on a call recompiles (slow, visible) instead of running eagerly
            with torch._dynamo.config.patch(recompile_limit=_MAX_UNITS, accumulated_recompile_limit=4 * _MAX_UNITS):
                return fn(*xs)

        return run

    def report(self) -> TargetReport:
        from torch._dynamo.utils import counters

        rep = super().report()
        rep.ops_lowered = dict(self._ops)
        rep.ops_fallback = {str(k): int(v) for k, v in counters["graph_break"].items()}
        rep.notes.append(f"{self._graphs} graph(s) compiled by Inductor for {len(self._cache)} unit shape(s)")
        return rep
