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

Mixture of experts: all experts of a layer run in one grouped GEMM (`aten._grouped_mm`, rows grouped
by expert through its `offs`), so the op alone cannot say which expert is wrong. Its isolated output
is therefore also compared group by group: when some experts' rows are over tolerance and others
are not, the record names the first bad expert (`expert`, module `layers.i.mlp.experts.E`).

Weights: the isolated side runs every op on the reference's weights, so a weight that differs
from the reference's (a bad conversion, a corrupted load) fails no op. `check_weights` compares the
unit's own parameters with the reference's, stacked expert tensors ([X, ...]) one expert at a time.
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
    expert: int | None = None  # grouped GEMM: the first expert whose rows alone are over tolerance
    experts: list[dict[str, Any]] | None = None  # grouped GEMM: per expert with rows, its isolated metrics

    def to_dict(self) -> dict[str, Any]:
        d = {"index": self.index, "node": self.node, "op": self.op, "module": self.module, "layer": self.layer,
             "source": self.source, "code": self.code, "isolated": self.isolated.to_dict(),
             "propagated": self.propagated.to_dict()}
        if self.experts is not None:
            d.update(expert=self.expert, experts=self.experts)
        return d


@dataclass
class WeightRecord:
    """A unit parameter (one expert's slice of a stacked one) that differs from the reference's."""

    param: str  # our parameter name, e.g. layers.1.mlp.experts.down_proj
    module: str  # its module, or the expert's: layers.1.mlp.experts.3
    expert: int | None
    layer: int | None
    source: str | None  # the model line of the first op that reads it
    code: str | None
    metrics: TensorMetrics

    def to_dict(self) -> dict[str, Any]:
        """Shaped like an op record (op `weight`), so it can stand as the culprit."""
        return {"index": None, "node": None, "op": "weight", "kind": "weight", "param": self.param,
                "module": self.module, "expert": self.expert, "layer": self.layer, "source": self.source,
                "code": self.code, "isolated": self.metrics.to_dict(), "propagated": self.metrics.to_dict()}


@dataclass
class Replay:
    ops: list[OpRecord]
    weights: list[WeightRecord]  # only those over tolerance


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


def _group_offsets(op: Any, args: Any, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The `offs` of a grouped GEMM (the end row of each group), or None for any other op."""
    if "grouped_mm" not in str(op):
        return None
    names = [a.name for a in op._schema.arguments]
    offs = kwargs.get("offs")
    if offs is None and "offs" in names and len(args) > names.index("offs"):
        offs = args[names.index("offs")]
    return offs if isinstance(offs, torch.Tensor) else None


def _per_group(out: Any, ref: Any, offs: torch.Tensor, dtype: torch.dtype,
               tol: Any) -> tuple[int | None, list[dict[str, Any]]]:
    """(first bad group, per group with rows its metrics) of a grouped GEMM's [N, *] output; the
    first bad group only when some groups with rows are within tolerance (else the whole op is off)."""
    if not (isinstance(out, torch.Tensor) and isinstance(ref, torch.Tensor)) or out.shape != ref.shape:
        return None, []
    ends = offs.tolist()
    rows, start = [], 0
    for e, end in enumerate(ends):
        if end > start:
            m = compare(out[start:end], ref[start:end], dtype, tol)
            rows.append({"expert": e, "rows": end - start, "isolated": m})
        start = end
    bad = [r["expert"] for r in rows if not r["isolated"].ok]
    first = bad[0] if bad and len(bad) < len(rows) else None
    return first, [{**r, "isolated": r["isolated"].to_dict()} for r in rows]


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
) -> Replay:
    """Trace `unit_t` (target model, target dtype) and replay it; one record per ATen op node, and
    the unit's parameters that differ from the reference's (`check_weights`).

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
            rec = OpRecord(
                index=len(records), node=node.name, op=name, module=module, layer=site.layer,
                source=source, code=code,
                isolated=_compare_any(iso_out, ref_out, policy.dtype, policy, tensor_name),
                propagated=_compare_any(tgt_out, ref_out, policy.dtype, policy, tensor_name),
            )
            offs = _group_offsets(node.target, iso_args, iso_kwargs)
            if offs is not None:
                rec.expert, rec.experts = _per_group(iso_out, ref_out, offs, policy.dtype, policy.for_tensor(tensor_name))
                if rec.expert is not None:
                    rec.module = f"{module}.{rec.expert}"
            records.append(rec)
    return Replay(records, check_weights(unit_t, ref_params, policy, _first_users(gm, by_id_t)))


def _first_users(gm: fx.GraphModule, by_id: dict[int, str]) -> dict[str, tuple[str | None, str | None]]:
    """Adapter parameter name → (source, code) of the first op that reads it."""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    out: dict[str, tuple[str | None, str | None]] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and (name := by_id.get(id(getattr(gm, node.target)))) is not None and node.users:
            out[name] = source_of(min(node.users, key=order.__getitem__).meta.get("stack_trace"))
    return out


def check_weights(unit_t: Unit, ref_params: dict[str, torch.Tensor], policy: TolerancePolicy,
                  sources: dict[str, tuple[str | None, str | None]] | None = None) -> list[WeightRecord]:
    """The unit's parameters (by adapter name, in `ref_params`) that differ from the reference's
    beyond the tensor tolerance; a stacked expert tensor ([X, ...] of a module with `num_experts`)
    one expert at a time, so the record names the expert."""
    bad: list[WeightRecord] = []
    named = dict(unit_t.adapter.named_parameters())
    for name, ref in ref_params.items():
        t = named.get(name)
        if t is None or t.shape != ref.shape:
            continue
        module_name, _, leaf = name.rpartition(".")
        module = unit_t.model_path(module_name)
        param = f"{module}.{leaf}"
        owner = unit_t.adapter.get_submodule(module_name) if module_name else unit_t.adapter
        num_experts = getattr(owner, "num_experts", None)
        per_expert = isinstance(num_experts, int) and t.ndim == 3 and t.shape[0] == num_experts
        source, code = (sources or {}).get(name, (None, None))
        for e, (t_e, r_e) in enumerate(zip(t, ref, strict=True) if per_expert else [(t, ref)]):
            m = compare(t_e.detach(), r_e, policy.dtype, policy.for_tensor(f"{param}:weight"))
            if not m.ok:
                bad.append(WeightRecord(param=param, module=f"{module}.{e}" if per_expert else module,
                                        expert=e if per_expert else None, layer=layer_of(module),
                                        source=source, code=code, metrics=m))
    return bad


def culprit(records: list[OpRecord]) -> OpRecord | None:
    """The first op whose isolated error is over tolerance."""
    return next((r for r in records if not r.isolated.ok), None)
