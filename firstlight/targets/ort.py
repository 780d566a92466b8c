"""`onnxruntime`: each unit exported with torch.onnx (dynamo exporter), run by ONNX Runtime on CPU.

Parameters are graph inputs, so one ONNX model serves every layer of a type. Reports the ONNX op
types in the exported graphs and the execution providers; float32 only (ORT's CPU provider has
few bfloat16 kernels).
"""

from __future__ import annotations

import logging
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from firstlight.targets.base import Target, TargetError, TargetReport


class OnnxRuntimeTarget(Target):
    name = "onnxruntime"
    supports_hooks = False

    def __init__(self, dtype: torch.dtype = torch.float32, opset: str = "18", **options: str) -> None:
        super().__init__(dtype, **options)
        if dtype != torch.float32:
            raise TargetError(f"onnxruntime target runs float32 only (got {dtype}); use --dtype float32")
        try:
            import onnxruntime  # noqa: F401
        except ImportError as e:
            raise TargetError("onnxruntime target needs `pip install onnx onnxruntime onnxscript`") from e
        self.opset = int(opset)
        self._cache: dict[tuple[str, tuple], Callable[..., Any]] = {}
        self._ops: Counter[str] = Counter()
        self._providers: set[str] = set()

    def compile(self, unit: nn.Module, example_inputs: Sequence[torch.Tensor], key: str) -> Callable[..., Any]:
        shapes = tuple((tuple(t.shape), t.dtype) for t in example_inputs)
        if (key, shapes) not in self._cache:
            self._cache[(key, shapes)] = self._export(unit, tuple(example_inputs))
        return self._cache[(key, shapes)]

    def _export(self, unit: nn.Module, inputs: tuple[torch.Tensor, ...]) -> Callable[..., Any]:
        import onnxruntime as ort

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            level = logging.getLogger("torch.onnx").level
            logging.getLogger("torch.onnx").setLevel(logging.ERROR)
            try:
                program = torch.onnx.export(unit, inputs, dynamo=True, opset_version=self.opset, verbose=False)
            finally:
                logging.getLogger("torch.onnx").setLevel(level)
        proto = program.model_proto
        for node in proto.graph.node:
            self._ops[node.op_type] += 1
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = torch.get_num_threads()
        session = ort.InferenceSession(proto.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        self._providers.update(session.get_providers())
        names = [i.name for i in session.get_inputs()]

        def run(*xs: torch.Tensor) -> Any:
            feed = {n: x.detach().cpu().numpy() for n, x in zip(names, xs, strict=False)}
            outs = [torch.from_numpy(np.asarray(o)) for o in session.run(None, feed)]
            return outs[0] if len(outs) == 1 else tuple(outs)

        return run

    def report(self) -> TargetReport:
        rep = super().report()
        rep.ops_lowered = dict(self._ops)
        rep.notes.append(f"providers: {', '.join(sorted(self._providers)) or '-'}; {len(self._cache)} exported unit shape(s)")
        return rep
