"""`emulate:<chip>`: run a model the way a chip's hardware spec says it computes, and price it.

    firstlight verify --target emulate:wormhole-n300 [--overrides FILE]

The chip's `numerics` section (firstlight/sim/specs/<chip>.yaml, schema in core/hardware.py) says
which formats tensors and matmul operands are held in, how the matrix unit multiplies (fidelity)
and accumulates, which vector-unit approximations compute exp / reciprocal / GELU, and which ATen
ops its compiler lowers. The target runs the model eagerly under a dispatch mode that sends every
ATen op through `run_op`, which computes it in those numerics (emulated_ops.py). So every unit the
verifier builds (whole model, layers, decode steps) runs emulated, and the op-by-op replay of a
failing unit uses the very same kernels.

Compile time, as a chip compiler would: `compile()` runs the unit once in plain eager mode,
recording its ops; an op outside `lowered_ops` that no override decomposes or sends to the host is
a TargetError naming the op and the model source line that made it (exit 2 from verify).

The same spec prices the configuration (emulated_cost.py): prefill, decode step and tokens/s on
that chip, so a precision choice shows its cost next to its error in the verify report.
"""

from __future__ import annotations

import functools
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from firstlight.core.hardware import HardwareSpec, HardwareSpecError, MatmulNumericsSpec, load_spec
from firstlight.numerics import APPROX, FIDELITIES, NumericsError, get_format
from firstlight.targets import emulated_ops as K
from firstlight.targets.base import OpNotLoweredError, OpSite, Target, TargetError, TargetReport, op_name
from firstlight.targets.decompose import DecomposedSDPA
from firstlight.targets.faulty import layer_of
from firstlight.targets.overrides import Overrides, load_overrides, module_matches, op_matches

TABLES_MODULE = "rotary"  # the models' table builder (models/layers.py RotaryTables)
_TOLERANCE_DTYPE = {"fp32": torch.float32, "fp16": torch.float16}  # anything narrower is judged as bf16


class _Recorder(TorchDispatchMode):
    """Compile-time pass: which ATen ops a unit runs, in which module, from which model line."""

    def __init__(self, target: EmulatedTarget) -> None:
        super().__init__()
        self.target = target
        self.missing: dict[str, tuple[str, str | None]] = {}  # op -> (module, source line)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if _is_composite(func):
            with self:
                return func.decompose(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        name = K.packet(func)
        if name not in self.missing and self.target.needs_lowering(name, out):
            module = self.target.current_module()
            cfg = self.target.site_numerics(module, name)
            if not (cfg.fallback or (cfg.decompose and name in K.DECOMPOSITIONS)):
                self.missing[name] = (module, _model_source_line())
        return out


class _EmulateMode(TorchDispatchMode):
    def __init__(self, target: EmulatedTarget) -> None:
        super().__init__()
        self.target = target

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if _is_composite(func):
            with self:
                return func.decompose(*args, **(kwargs or {}))
        t = self.target
        path = t.current_module()
        name = op_name(func)
        counts = t._counts.setdefault(path, {})
        nth = counts.get(name, 0)
        counts[name] = nth + 1
        return t.run_op(func, args, kwargs or {}, OpSite(module=path, layer=layer_of(path), nth=nth, op=name))


@functools.cache
def _is_composite(func: Any) -> bool:
    """An op made of other ATen ops (linear, softmax, ...): it reaches a dispatch mode whole under
    inference mode; decomposing it there sends the ops it is made of through the mode, as always."""
    return isinstance(func, torch._ops.OpOverload) and torch._C._dispatch_has_kernel_for_dispatch_key(
        func.name(), "CompositeImplicitAutograd")


def _model_source_line() -> str | None:
    """'firstlight/models/layers.py:36' of the innermost model frame on the Python stack."""
    for frame in reversed(traceback.extract_stack()):
        idx = frame.filename.rfind("/firstlight/models/")
        if idx >= 0:
            return f"{frame.filename[idx + 1:]}:{frame.lineno}"
    return None


class EmulatedTarget(Target):
    """A chip emulated from its hardware spec: formats, fidelity, accumulators, approximations, op coverage."""

    name = "emulate"
    supports_hooks = True

    def __init__(self, dtype: torch.dtype = torch.float32, chip: str | None = None, overrides: str | Overrides | None = None,
                 seed: str | int = 0, **options: str) -> None:
        if options:
            raise TargetError(f"target 'emulate' takes chip, overrides=FILE, seed=N; got unknown option(s) "
                              f"{', '.join(sorted(options))}")
        if chip is None:
            raise TargetError("target 'emulate' needs a chip: emulate:<chip>, e.g. emulate:wormhole-n300 "
                              "(chips with a numerics section: " + ", ".join(emulated_chips()) + ")")
        if dtype != torch.float32:
            raise TargetError(f"target 'emulate:{chip}' computes in the chip's own formats (its spec's numerics); "
                              f"run it with --dtype float32, not {str(dtype).removeprefix('torch.')}, and change formats "
                              "with --overrides")
        super().__init__(dtype)
        try:
            self.spec: HardwareSpec = load_spec(chip)
        except HardwareSpecError as e:
            raise TargetError(f"target 'emulate:{chip}': {e}") from None
        if self.spec.numerics is None:
            raise TargetError(f"chip '{chip}' ({self.spec.name}) has no numerics section, so it cannot be emulated; "
                              f"emulated chips: {', '.join(emulated_chips())} (docs/EMULATION.md says how to add one)")
        self.chip = chip
        self.numerics = self.spec.numerics
        self.seed = int(seed)
        self.overrides = overrides if isinstance(overrides, Overrides) else (
            load_overrides(overrides) if overrides else Overrides())
        if self.overrides.chip and load_spec(self.overrides.chip).name != self.spec.name:
            raise TargetError(f"overrides are for chip '{self.overrides.chip}', not '{chip}'")
        self._check_names()
        self.tolerance_dtype = _TOLERANCE_DTYPE.get(self.numerics.activation, torch.bfloat16)
        self._lowered = frozenset(self.numerics.lowered_ops)
        self._stack: list[str] = []
        self._counts: dict[str, dict[str, int]] = {}
        self._site_cache: dict[tuple[str, str], K.SiteNumerics] = {}
        self._checked_keys: set[str] = set()
        self._weights = K.WeightCache()
        self._model: nn.Module | None = None
        self.ops_emulated: Counter[str] = Counter()
        self.ops_host: Counter[str] = Counter()
        self.host_bytes = 0
        self.last_forward: dict[str, float] = {}  # compute ops, host calls and bytes of the last whole-model run

    # ---- configuration ------------------------------------------------------------------------------
    def _check_names(self) -> None:
        """Every format, fidelity and approximation the spec and overrides name exists (else exit 2)."""
        n = self.numerics

        def fmt(value: str | None, key: str) -> None:
            if value is None:
                return
            try:
                get_format(value)
            except NumericsError as e:
                raise TargetError(f"{key}: {e}") from None

        def matmul(m: MatmulNumericsSpec | Any, key: str) -> None:
            for f in ("a_format", "b_format", "accumulator"):
                fmt(getattr(m, f, None), f"{key}.{f}")
            fid = getattr(m, "fidelity", None)
            if fid is not None and fid not in FIDELITIES:
                raise TargetError(f"{key}.fidelity: unknown math fidelity '{fid}'; known: {', '.join(FIDELITIES)}")

        def impl(op: str, name: str | None, key: str) -> None:
            if name is None:
                return
            if op not in APPROX or name not in APPROX[op]:
                known = ", ".join(f"{o}: {'/'.join(sorted(v))}" for o, v in sorted(APPROX.items()))
                raise TargetError(f"{key}: no approximation '{name}' for '{op}'; known: {known}")

        where = f"chip '{self.chip}' numerics"
        fmt(n.activation, f"{where}.activation")
        fmt(n.embedding, f"{where}.embedding")
        fmt(n.tables, f"{where}.tables")
        matmul(n.matmul, f"{where}.matmul")
        if n.attention_matmul is not None:
            matmul(n.attention_matmul, f"{where}.attention_matmul")
        for op, name in n.transcendentals.items():
            impl(op, name, f"{where}.transcendentals.{op}")
        for i, rule in enumerate(self.overrides.rules):
            key = f"overrides.rules[{i}]"
            fmt(rule.activation, f"{key}.activation")
            if rule.matmul is not None:
                matmul(rule.matmul, f"{key}.matmul")
            if rule.op is not None and not any(c in rule.op for c in "*?["):
                base = rule.op.removeprefix("aten.").split(".")[0]
                if not rule.op.startswith("aten.") or not hasattr(torch.ops.aten, base):
                    raise TargetError(f"{key}.op: '{rule.op}' is not an ATen op (e.g. aten.mm, aten.exp, aten._softmax)")
            if rule.transcendental is not None:
                ops = [v for k, v in K.APPROX_OPS.items() if rule.op is None or op_matches(rule.op, k)]
                if not ops:
                    raise TargetError(f"{key}.transcendental: op '{rule.op}' has no approximation; "
                                      f"ops that do: {', '.join(sorted(K.APPROX_OPS))}")
                for op in ops:
                    impl(op, rule.transcendental, f"{key}.transcendental")
            if rule.decompose and rule.op is not None and not any(op_matches(rule.op, o) for o in K.DECOMPOSITIONS):
                raise TargetError(f"{key}.decompose: no decomposition for '{rule.op}'; "
                                  f"decomposable: {', '.join(sorted(K.DECOMPOSITIONS))}")

    def site_numerics(self, module: str, op: str) -> K.SiteNumerics:
        """The numerics of op packet `op` at module path `module`: the spec, then matching rules in order."""
        key = (module, op)
        hit = self._site_cache.get(key)
        if hit is not None:
            return hit
        n = self.numerics
        attention = op in K.ATTENTION_MATMULS
        base = n.attention_matmul or n.matmul.model_copy(update={"b_format": n.matmul.a_format,
                                                                 "b_scaling": n.matmul.a_scaling})
        mm = base if attention else n.matmul
        activation = n.activation
        if op == "aten.embedding" and n.embedding:
            activation = n.embedding
        if module_matches(TABLES_MODULE, module):
            activation = n.tables
        impl = n.transcendentals.get(K.APPROX_OPS.get(op, ""), "exact") if op in K.APPROX_OPS else None
        fallback = decompose = False
        for rule in self.overrides.rules:
            if not rule.matches(module, op):
                continue
            activation = rule.activation or activation
            if rule.matmul is not None:
                mm = mm.model_copy(update=rule.matmul.set_fields())
            if rule.transcendental is not None and op in K.APPROX_OPS:
                impl = rule.transcendental
            if rule.fallback is not None:
                fallback = rule.fallback == "host"
            if rule.decompose is not None:
                decompose = rule.decompose
        cfg = K.SiteNumerics(activation=activation, matmul=mm, b_block_axis=-1 if mm.b_blocks_along == "n" else -2,
                             tile=n.tile, impl=impl, fallback=fallback, decompose=decompose, seed=self.seed)
        self._site_cache[key] = cfg
        return cfg

    def needs_lowering(self, name: str, out: Any) -> bool:
        """A compute op (floating output, not a movement op) the compiler does not lower."""
        if K.is_movement(name) or name in self._lowered:
            return False
        outs = out if isinstance(out, (tuple, list)) else [out]
        return any(isinstance(o, torch.Tensor) and o.is_floating_point() for o in outs)

    # ---- the Target contract ------------------------------------------------------------------------
    def prepare(self, model: nn.Module) -> nn.Module:
        self._model = model
        self._weights.pin(model.parameters())
        paths = [p for p, _ in model.named_modules()]
        for i, rule in enumerate(self.overrides.rules):
            if rule.module is not None and not any(module_matches(rule.module, p) for p in paths):
                sample = ", ".join(p for p in paths[:8] if p)
                raise TargetError(f"overrides.rules[{i}].module: '{rule.module}' names no module of this model "
                                  f"(module paths look like: {sample}, ...)")
        for path, module in model.named_modules():
            module.register_forward_pre_hook(self._enter(path))
            module.register_forward_hook(self._leave)
        return model

    def sites_seen(self) -> list[tuple[str, str]]:
        """Every (module, op packet) this target has computed numerics for: the sites its runs dispatched."""
        return list(self._site_cache)

    def release_prepared(self) -> None:
        """Drop the weights prepared for this configuration (quantized, fidelity-split, rounded copies:
        several times the model's bytes at HiFi4). The next forward prepares them again; a caller that
        keeps finished runs around for their reports (the bring-up loop) calls this after each."""
        self._weights = K.WeightCache()
        if self._model is not None:
            self._weights.pin(self._model.parameters())

    def _enter(self, path: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            self._stack.append(path)
            self._counts.pop(path, None)

        return hook

    def _leave(self, module: nn.Module, args: Any, out: Any) -> None:
        if self._stack:
            self._stack.pop()

    def current_module(self) -> str:
        return self._stack[-1] if self._stack else ""

    def compile(self, unit: nn.Module, example_inputs: Sequence[torch.Tensor], key: str) -> Callable[..., Any]:
        if key not in self._checked_keys:
            self._check_coverage(unit, example_inputs, key)
            self._checked_keys.add(key)

        def run(*inputs: torch.Tensor) -> Any:
            self._stack.clear()
            self._counts.clear()
            before = (sum(self.ops_emulated.values()), sum(self.ops_host.values()), self.host_bytes)
            try:
                with torch.no_grad(), DecomposedSDPA(), _EmulateMode(self):
                    return unit(*inputs)
            finally:
                self._stack.clear()
                if key == "logits":
                    self.last_forward = {"compute_ops": sum(self.ops_emulated.values()) - before[0],
                                         "host_calls": sum(self.ops_host.values()) - before[1],
                                         "host_bytes": self.host_bytes - before[2],
                                         "tokens": float(inputs[0].numel())}

        return run

    def _check_coverage(self, unit: nn.Module, inputs: Sequence[torch.Tensor], key: str) -> None:
        rec = _Recorder(self)
        self._stack.clear()
        with torch.no_grad(), DecomposedSDPA(), rec:
            unit(*inputs)
        self._stack.clear()
        if rec.missing:
            op, (module, line) = next(iter(rec.missing.items()))
            others = [o for o in rec.missing if o != op]
            raise OpNotLoweredError(
                f"chip '{self.chip}' does not lower {op} (in {module or 'the model'}"
                f"{f', made at {line}' if line else ''}; compiling unit '{key}')"
                + (f"; also not lowered: {', '.join(others)}" if others else "")
                + f". Override it: 'op: {op}' with 'fallback: host'"
                + (" or 'decompose: true'" if op in K.DECOMPOSITIONS else "") + " (--overrides FILE)",
                op=op, module=module, line=line)

    def run_op(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], site: OpSite) -> Any:
        name = K.packet(op)
        if K.is_movement(name):
            return K.carry_format(op(*args, **kwargs), args)
        cfg = self.site_numerics(site.module, name)
        if cfg.fallback:
            return self._on_host(op, name, args, kwargs, cfg)
        if cfg.decompose and name in K.DECOMPOSITIONS:
            def call(sub: Any, *a: Any) -> Any:
                return self.run_op(sub, a, {}, OpSite(site.module, site.layer, site.nth, op_name(sub)))
            return K.DECOMPOSITIONS[name](call, *args, **kwargs)
        if name not in self._lowered:
            out = op(*args, **kwargs)
            if not self.needs_lowering(name, out):
                return out
            raise TargetError(f"chip '{self.chip}' does not lower {name} (in {site.module or 'the model'}); "
                              "override it with 'fallback: host' or 'decompose: true'")
        self.ops_emulated[name] += 1
        if name in K.WEIGHT_MATMULS or name in K.ATTENTION_MATMULS:  # operands go to their own formats
            return K.run_matmul(name, args, kwargs, cfg, self._weights)
        args = K.round_inputs(self._weights.held(args, cfg.activation), cfg.activation)
        if name == "aten._softmax":
            return K.run_softmax(args[0], args[1], self._impl(site.module, "aten.exp"),
                                 self._impl(site.module, "aten.reciprocal"), cfg.activation)
        if name in K.APPROX_OPS and cfg.impl not in (None, "exact"):
            return K.run_approx(name, args, kwargs, cfg.impl, cfg.activation)
        return K._map(op(*args, **kwargs), lambda t: K.round_to(t, cfg.activation))

    def _impl(self, module: str, op: str) -> str:
        return self.site_numerics(module, op).impl or "exact"

    def _on_host(self, op: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], cfg: K.SiteNumerics) -> Any:
        out = op(*K._map(args, lambda t: t.float()), **kwargs)
        self.ops_host[name] += 1
        tensors = [t for t in (*args, out) if isinstance(t, torch.Tensor)]
        self.host_bytes += sum(t.numel() * 2 for t in tensors)  # crosses the link in 16-bit activations
        return K._map(out, lambda t: K.round_to(t, cfg.activation))

    def report(self) -> TargetReport:
        rep = TargetReport(name=f"emulate:{self.chip}", dtype=self.numerics.activation,
                           ops_lowered=dict(self.ops_emulated), ops_fallback=dict(self.ops_host))
        m = self.numerics.matmul
        rep.notes.append(f"chip {self.spec.name}: activations {self.numerics.activation}; weight matmuls "
                         f"{m.a_format} x {m.b_format}, fidelity {m.fidelity or 'full'}, accumulator {m.accumulator}"
                         + (f" (promoted every {m.promotion_interval})" if m.promotion_interval else ""))
        rep.notes += [f"override {r.describe()}" for r in self.overrides.rules]
        if self._model is not None:
            from firstlight.targets.emulated_cost import predict

            rep.details["predicted"] = predict(self._model, self.spec, self.site_numerics, self.last_forward)
        rep.details["overrides"] = self.overrides.model_dump(exclude_none=True)
        return rep


def emulated_chips() -> list[str]:
    """Builtin spec names that carry a numerics section (the chips `emulate:` accepts)."""
    import yaml

    from firstlight.core.hardware import builtin_spec_dir

    out = []
    for p in sorted(Path(builtin_spec_dir()).glob("*.yaml")):
        if "numerics" in (yaml.safe_load(p.read_text()) or {}):
            out.append(p.stem)
    return out + ["mx"]
