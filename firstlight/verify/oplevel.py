"""Op-level replay of one unit: its ATen graph, run node by node on the reference and the target.

The unit is traced once with `make_fx` in the target dtype (so the graph holds the target's dtype
casts), with SDPA decomposed so softmax and masking are separate ops. Then an interpreter walks
the graph three ways at once:

    reference  every node in fp32 (low-precision dtype arguments promoted), fp32 weights
    propagate  every node through `target.run_op` on the target's own previous outputs
    isolate    every node through `target.run_op` on the *reference* inputs, cast to target dtype

Isolated error is the error an op introduces; propagated error is what it inherits plus that. The
first op whose isolated error is over tolerance is the culprit; its module path comes from the
node's `nn_module_stack`, its source line from the node's `stack_trace`. Only one unit's tensors
are alive at a time.
"""

from __future__ import annotations

import inspect
import operator
import re
import sys
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

from firstlight.targets.base import OpSite, Target, op_name
from firstlight.targets.decompose import DecomposedSDPA
from firstlight.targets.faulty import layer_of
from firstlight.verify.metrics import TensorMetrics, compare
from firstlight.verify.tolerance import TolerancePolicy
from firstlight.verify.units import Unit

_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)')
_LOW = (torch.bfloat16, torch.float16)


@dataclass
class OpRecord:
    index: int
    node: str
    op: str
    module: str
    layer: int | None
    source: str | None
    code: str | None
    isolated: TensorMetrics
    propagated: TensorMetrics

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "node": self.node, "op": self.op, "module": self.module, "layer": self.layer,
                "source": self.source, "code": self.code, "isolated": self.isolated.to_dict(),
                "propagated": self.propagated.to_dict()}


def source_of(stack_trace: str | None) -> tuple[str | None, str | None]:
    """('firstlight/models/layers.py:36', code) of the innermost model frame of an FX stack trace."""
    if not stack_trace:
        return None, None
    frames = _FRAME.findall(stack_trace)
    # The model's own line if there is one, else the innermost frame outside the harness.
    for pred in (lambda f: "/firstlight/models/" in f,
                 lambda f: "/firstlight/verify/" not in f and "/firstlight/targets/" not in f):
        hits = [fr for fr in frames if pred(fr[0])]
        if hits:
            file, line, _, code = hits[-1]
            for root in ("/firstlight/", "/site-packages/"):
                idx = file.rfind(root)
                if idx >= 0:
                    file = file[idx + 1:] if root == "/firstlight/" else file[idx + len(root):]
                    break
            return f"{file}:{line}", code.strip()
    return None, None


def _anchor_model_functions(root: torch.nn.Module) -> None:
    """Keep the model files' own functions in FX stack traces, not only `forward` frames.

    make_fx records a node's stack with frames named `forward` only, unless a (file, function) is
    registered as an anchor; the model's `embed`, `compute_logits`, `apply_rope`, ... are, so a
    node's source line is the model file's line that made it (the embedding gather included).
    """
    register = getattr(fx.proxy, "_register_stack_trace_anchor", None)
    if register is None:  # older/newer torch without anchors: forward frames only
        return
    names = {type(m).__module__ for m in root.modules()} | {c.__module__ for c in type(root).__mro__}
    for name in sorted(n for n in names if n.startswith("firstlight.models")):
        for obj in vars(sys.modules[name]).values():
            members = vars(obj).values() if inspect.isclass(obj) else [obj]
            for fn in members:
                if inspect.isfunction(fn) and fn.__module__ == name:
                    register(fn)


def trace_unit(unit: Unit, inputs: tuple[torch.Tensor, ...]) -> fx.GraphModule:
    adapter = unit.adapter
    _anchor_model_functions(adapter)

    def fn(*args: torch.Tensor) -> Any:
        with DecomposedSDPA():
            return adapter(*args)

    fn._orig_mod = adapter  # lets make_fx record nn_module_stack relative to the adapter
    with torch.no_grad():
        return make_fx(fn, record_module_stack=True, record_stack_traces=True)(*inputs)


def _module_of(node: fx.Node, unit: Unit) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    path = list(stack.values())[-1][0] if stack else ""
    return unit.model_path(path)


def _map(x: Any, fn: Any) -> Any:
    return fx.node.map_aggregate(x, fn)


def _promote(x: Any) -> Any:
    if isinstance(x, torch.dtype) and x in _LOW:
        return torch.float32
    if isinstance(x, torch.Tensor) and x.dtype in _LOW:
        return x.float()
    return x


def _compare_any(out: Any, ref: Any, dtype: torch.dtype, policy: TolerancePolicy, name: str) -> TensorMetrics:
    outs = [o for o in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(o, torch.Tensor)]
    refs = [r for r in (ref if isinstance(ref, (tuple, list)) else [ref]) if isinstance(r, torch.Tensor)]
    if not refs:
        return TensorMetrics(0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0, True)
    results = [compare(o, r, dtype, policy.for_tensor(name)) for o, r in zip(outs, refs, strict=False)]
    bad = [m for m in results if not m.ok]
    return bad[0] if bad else results[0]


@torch.no_grad()
def replay(
    unit_t: Unit,
    ref_params: dict[str, torch.Tensor],
    inputs_t: tuple[torch.Tensor, ...],
    inputs_ref: tuple[torch.Tensor, ...],
    target: Target,
    policy: TolerancePolicy,
) -> list[OpRecord]:
    """Trace `unit_t` (target model, target dtype) and replay it; one record per ATen op node.

    `ref_params`: the unit's fp32 reference weights by adapter parameter name (the rest of a
    unit's constants are promoted from the target's own).
    """
    gm = trace_unit(unit_t, inputs_t)
    by_id_t = {id(t): n for n, t in [*unit_t.adapter.named_parameters(), *unit_t.adapter.named_buffers()]}
    named_ref = ref_params
    ref_env: dict[fx.Node, Any] = {}
    tgt_env: dict[fx.Node, Any] = {}
    counts: dict[tuple[str, str], int] = defaultdict(int)
    records: list[OpRecord] = []
    placeholders = iter(zip(inputs_ref, inputs_t, strict=True))
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            ref_env[node], tgt_env[node] = next(placeholders)
        elif node.op == "get_attr":
            value = getattr(gm, node.target)
            name = by_id_t.get(id(value))
            tgt_env[node] = value
            ref_env[node] = named_ref[name].float() if name in named_ref else _promote(value)
        elif node.op == "call_function":
            ref_args = _map(node.args, lambda a: _promote(ref_env[a]) if isinstance(a, fx.Node) else _promote(a))
            ref_kwargs = _map(node.kwargs, lambda a: _promote(ref_env[a]) if isinstance(a, fx.Node) else _promote(a))
            tgt_args = _map(node.args, lambda a: tgt_env[a] if isinstance(a, fx.Node) else a)
            tgt_kwargs = _map(node.kwargs, lambda a: tgt_env[a] if isinstance(a, fx.Node) else a)
            if node.target is operator.getitem or not isinstance(node.target, torch._ops.OpOverload):
                ref_env[node] = node.target(*ref_args, **ref_kwargs)
                tgt_env[node] = node.target(*tgt_args, **tgt_kwargs)
                continue

            def as_target(a: Any) -> Any:
                if not isinstance(a, fx.Node):
                    return a
                r, t = ref_env[a], tgt_env[a]
                if isinstance(r, torch.Tensor) and isinstance(t, torch.Tensor):
                    return r.to(t.dtype)
                return t

            iso_args = _map(node.args, as_target)
            iso_kwargs = _map(node.kwargs, as_target)
            name = op_name(node.target)
            module = _module_of(node, unit_t)
            site = OpSite(module=module, layer=layer_of(module), nth=counts[(module, name)], op=name,
                          phase=getattr(unit_t, "phase", "prefill"))
            counts[(module, name)] += 1
            ref_out = node.target(*ref_args, **ref_kwargs)
            tgt_out = target.run_op(node.target, tgt_args, tgt_kwargs, site)
            iso_out = target.run_op(node.target, iso_args, iso_kwargs, site)
            ref_env[node], tgt_env[node] = ref_out, tgt_out
            source, code = source_of(node.meta.get("stack_trace"))
            tensor_name = f"{module}:{name}"
            records.append(OpRecord(
                index=len(records), node=node.name, op=name, module=module, layer=site.layer,
                source=source, code=code,
                isolated=_compare_any(iso_out, ref_out, policy.dtype, policy, tensor_name),
                propagated=_compare_any(tgt_out, ref_out, policy.dtype, policy, tensor_name),
            ))
    return records


def culprit(records: list[OpRecord]) -> OpRecord | None:
    """The first op whose isolated error is over tolerance."""
    return next((r for r in records if not r.isolated.ok), None)
