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

from firstlight.targets.base import Target, TargetReport


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
            fn(*example_inputs)  # compile now, so a compile error is reported as one
            self._cache[(key, shapes)] = fn
        return self._cache[(key, shapes)]

    def report(self) -> TargetReport:
        from torch._dynamo.utils import counters

        rep = super().report()
        rep.ops_lowered = dict(self._ops)
        rep.ops_fallback = {str(k): int(v) for k, v in counters["graph_break"].items()}
        rep.notes.append(f"{self._graphs} graph(s) compiled by Inductor for {len(self._cache)} unit shape(s)")
        return rep
