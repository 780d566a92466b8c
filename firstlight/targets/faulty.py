"""`faulty`: eager execution with planted faults, to prove the harness finds what it should.

A fault picks ATen op calls by op name (glob: `aten.rsqrt`, `*mm*`), module path (glob on the
innermost module: `layers.2.input_layernorm`), layer index and n-th call of that op in that
module's forward, and perturbs them:

    scale      out * value               offset    out + value
    noise      out + value * std(out) * N(0, 1)
    dtype      out rounded through `to` (default bfloat16) and back
    transpose  operand `arg` (default 1) transposed in its last two dims before the op
    constant   scalar argument `arg` (default: the first number) replaced by `value`
    nan, inf   flat element `arg` (default 0) of the output set to NaN / +inf (one overflow)

More selectors: `phase=prefill|decode` (the phase of the unit being run, from its key: see
`unit_phase` in base.py; decode steps of verify's serving paths are `decode`), `from_row=R`
(perturb only rows >= R of the output's second-to-last dim: the late positions of a sequence),
`expert=E` (a grouped GEMM, `aten._grouped_mm`: perturb only the rows of group E, i.e. what
expert E computes in a mixture-of-experts layer).

Weight faults change the model's own parameters once, in `prepare`:

    kind=weight,param=GLOB[,expert=E]       parameters whose name matches GLOB (ours, e.g.
                                            layers.1.mlp.experts.down_proj) scaled by `value`;
                                            with `expert`, only slice E of a stacked [X, ...] one

Table faults corrupt what the model builds once per forward, everywhere the model builds it
(whole forward, serving steps, the `tables` unit), by wrapping the model's own table builders:

    kind=table,table=rope,min_position=P    cos/sin of every position p >= P computed for p * value
    kind=table,table=mask                   in a row that holds padding (a query at position -1),
                                            key slots with no key (position -1) are visible

Command line: `--target faulty:op=aten.rsqrt,module=layers.1.input_layernorm,kind=scale,value=2`.
SDPA is decomposed (see decompose.py) inside the modules a fault can select, so softmax and mask
ops can be hit; elsewhere the model runs as plain eager PyTorch.
"""

from __future__ import annotations

import fnmatch
import functools
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from firstlight.targets.base import OpSite, Target, TargetError, TargetReport, op_name, unit_phase
from firstlight.targets.decompose import DecomposedSDPA

KINDS = ("scale", "offset", "noise", "dtype", "transpose", "constant", "nan", "inf", "table", "weight")
PHASES = ("prefill", "decode")
TABLES = ("rope", "mask")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")
_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


@functools.lru_cache(maxsize=4096)
def layer_of(module_path: str) -> int | None:
    m = _LAYER.search(module_path)
    return int(m.group(1)) if m else None


@dataclass
class Fault:
    kind: str
    op: str | None = None
    module: str | None = None
    layer: int | None = None
    nth: int | None = None
    value: float = 2.0
    arg: int | None = None
    to: str = "bfloat16"
    seed: int = 0
    phase: str | None = None  # None: every phase
    from_row: int | None = None
    table: str | None = None  # kind=table: rope | mask
    min_position: int = 0  # kind=table,table=rope: first corrupted position
    expert: int | None = None  # grouped GEMM ops: only group E's rows; kind=weight: only slice E
    param: str | None = None  # kind=weight: glob on our parameter names
    hits: int = field(default=0, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise TargetError(f"fault kind '{self.kind}' is not one of: {', '.join(KINDS)}")
        if self.to not in _DTYPES:
            raise TargetError(f"fault dtype round-trip 'to={self.to}' must be one of: {', '.join(_DTYPES)}")
        if self.phase is not None and self.phase not in PHASES:
            raise TargetError(f"fault phase '{self.phase}' is not one of: {', '.join(PHASES)}")
        if self.kind == "weight":
            if self.param is None:
                raise TargetError("a weight fault needs param= (a glob on parameter names, e.g. layers.1.mlp.experts.down_proj)")
            return
        if self.param is not None:
            raise TargetError(f"param={self.param} is for kind=weight only (got kind={self.kind})")
        if self.kind == "table":
            if self.table not in TABLES:
                raise TargetError(f"a table fault needs table= one of: {', '.join(TABLES)} (got {self.table})")
            return
        if self.table is not None:
            raise TargetError(f"table={self.table} is for kind=table only (got kind={self.kind})")
        if self.op is None and self.module is None and self.layer is None:
            raise TargetError("a fault needs at least one of op=, module=, layer= (else it hits every op)")

    def matches(self, site: OpSite) -> bool:
        if self.kind in ("table", "weight"):
            return False
        if self.phase is not None and site.phase != self.phase:
            return False
        if self.op is not None:
            full = site.op
            packet = full.rsplit(".", 1)[0] if full.count(".") >= 2 else full
            short = packet.split(".", 1)[-1]
            if not any(fnmatch.fnmatchcase(n, self.op) for n in (full, packet, short)):
                return False
        if self.module is not None and not fnmatch.fnmatchcase(site.module, self.module):
            return False
        if self.layer is not None and site.layer != self.layer:
            return False
        return self.nth is None or self.nth == site.nth

    def apply(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.hits += 1
        if self.kind == "transpose":
            idx = 1 if self.arg is None else self.arg
            a = args[idx]
            if not isinstance(a, torch.Tensor) or a.ndim < 2 or a.shape[-1] != a.shape[-2]:
                raise TargetError(f"fault transpose: operand {idx} of {op_name(op)} is not square in its last two dims")
            args = (*args[:idx], a.transpose(-2, -1).contiguous(), *args[idx + 1:])
            return op(*args, **kwargs)
        if self.kind == "constant":
            idx = self.arg
            if idx is None:
                idx = next((i for i, a in enumerate(args) if isinstance(a, (int, float)) and not isinstance(a, bool)), None)
            if idx is None or idx >= len(args):
                raise TargetError(f"fault constant: {op_name(op)} has no scalar argument to replace")
            args = (*args[:idx], self.value, *args[idx + 1:])
            return op(*args, **kwargs)
        if self.expert is not None:
            return self._expert_rows(op, args, kwargs)
        return _map_float(op(*args, **kwargs), self._rows)

    def _expert_rows(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A grouped GEMM with only group `expert`'s output rows perturbed."""
        names = [a.name for a in op._schema.arguments]
        offs = kwargs.get("offs")
        if offs is None and "offs" in names and len(args) > names.index("offs"):
            offs = args[names.index("offs")]
        if not isinstance(offs, torch.Tensor):
            raise TargetError(f"fault expert={self.expert}: {op_name(op)} is not a grouped GEMM (no offs)")
        out = op(*args, **kwargs)
        ends = [0, *offs.tolist()]
        start, end = ends[self.expert], ends[self.expert + 1]
        if end <= start:
            return out
        return torch.cat([out[:start], self._perturb(out[start:end]), out[end:]])

    def plant_weight(self, model: nn.Module) -> None:
        """kind=weight: scale the matching parameters (slice `expert` of stacked ones) by `value`."""
        with torch.no_grad():
            for name, p in model.named_parameters():
                if fnmatch.fnmatchcase(name, self.param or ""):
                    (p[self.expert] if self.expert is not None else p).mul_(self.value)
                    self.hits += 1
        if not self.hits:
            raise TargetError(f"weight fault: no parameter matches param={self.param}")

    def _rows(self, out: torch.Tensor) -> torch.Tensor:
        """The perturbation, on rows >= from_row of dim -2 only when `from_row` is set."""
        if self.from_row is None:
            return self._perturb(out)
        if out.ndim < 2 or out.shape[-2] <= self.from_row:
            return out
        head, tail = out[..., : self.from_row, :], out[..., self.from_row:, :]
        return torch.cat([head, self._perturb(tail)], dim=-2)

    def _perturb(self, out: torch.Tensor) -> torch.Tensor:
        if self.kind in ("nan", "inf"):
            out = out.clone()
            flat = out.view(-1)
            flat[min(self.arg or 0, flat.numel() - 1)] = math.nan if self.kind == "nan" else math.inf
            return out
        if self.kind == "scale":
            return out * self.value
        if self.kind == "offset":
            return out + self.value
        if self.kind == "dtype":
            return out.to(_DTYPES[self.to]).to(out.dtype)
        gen = torch.Generator(device=out.device).manual_seed(self.seed + self.hits)
        noise = torch.randn(out.shape, generator=gen, device=out.device, dtype=torch.float32)
        return (out.float() + self.value * out.float().std() * noise).to(out.dtype)

    @classmethod
    def from_options(cls, options: dict[str, str]) -> Fault:
        known = {"kind", "op", "module", "layer", "nth", "value", "arg", "to", "seed", "phase", "from_row", "table",
                 "min_position", "expert", "param"}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TargetError(f"faulty target: unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        if "kind" not in options:
            raise TargetError(f"faulty target needs kind= (one of: {', '.join(KINDS)})")
        try:
            ints = {k: int(options[k]) for k in ("layer", "nth", "arg", "seed", "from_row", "min_position", "expert")
                    if k in options}
            value = {"value": float(options["value"])} if "value" in options else {}
        except ValueError as e:
            raise TargetError(f"faulty target: bad number in options ({e})") from e
        strs = {k: options[k] for k in ("op", "module", "to", "phase", "table", "param") if k in options}
        return cls(kind=options["kind"], **ints, **value, **strs)


def _map_float(out: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(out, torch.Tensor):
        return fn(out) if out.is_floating_point() else out
    if isinstance(out, (tuple, list)):
        return type(out)(_map_float(o, fn) for o in out)
    return out


class _FaultMode(TorchDispatchMode):
    def __init__(self, target: FaultyTarget) -> None:
        super().__init__()
        self.target = target

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        t = self.target
        path = t._stack[-1] if t._stack else ""
        name = op_name(func)
        counts = t._counts.setdefault(path, {})
        nth = counts.get(name, 0)
        counts[name] = nth + 1
        site = OpSite(module=path, layer=layer_of(path), nth=nth, op=name, phase=t._phase)
        return t.run_op(func, args, kwargs, site)


class FaultyTarget(Target):
    """Eager execution with `faults` applied to the ATen ops they select.

    Ops are intercepted (a Python dispatch mode) and SDPA is decomposed only inside modules a
    fault can select; the rest of the model runs as plain eager PyTorch, at eager speed and with
    eager numerics. A fault with neither `module` nor `layer` can hit any op: then the whole unit
    runs intercepted.
    """

    name = "faulty"

    def __init__(self, dtype: torch.dtype = torch.float32, faults: Sequence[Fault] | None = None, **options: str) -> None:
        self.dtype = dtype
        self.faults = list(faults or [])
        if options:
            self.faults.append(Fault.from_options(options))
        if not self.faults:
            raise TargetError("faulty target needs a fault, e.g. faulty:op=aten.rsqrt,layer=1,kind=scale,value=2")
        self._stack: list[str] = []
        self._counts: dict[str, dict[str, int]] = {}  # module path -> op name -> calls so far
        self._hooks: list[Any] = []
        self._everywhere = any(f.module is None and f.layer is None and f.kind not in ("table", "weight")
                               for f in self.faults)
        self._phase = "prefill"  # of the unit running now (its key, see unit_phase)
        self._running = False  # inside a compiled unit's run (not, e.g., the harness's make_fx trace)
        self._active: list[tuple[int, tuple[Any, ...]]] = []  # (stack depth that entered it, mode)

    def _can_hit(self, path: str) -> bool:
        """Whether any fault can select an op whose innermost module is `path`."""
        return any((f.layer is None or layer_of(path) == f.layer)
                   and (f.module is None or fnmatch.fnmatchcase(path, f.module))
                   for f in self.faults if f.kind not in ("table", "weight"))

    def prepare(self, model: nn.Module) -> nn.Module:
        for fault in self.faults:
            if fault.kind == "table":
                _plant_table_fault(model, fault)
            if fault.kind == "weight":
                fault.plant_weight(model)
        for path, module in model.named_modules():
            can_hit = self._can_hit(path)
            self._hooks.append(module.register_forward_pre_hook(self._enter(path, can_hit)))
            self._hooks.append(module.register_forward_hook(self._leave))
        return model

    def _enter(self, path: str, can_hit: bool) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            self._stack.append(path)
            self._counts.pop(path, None)
            if can_hit and self._running and not self._active:
                modes = (DecomposedSDPA(), _FaultMode(self))
                for mode in modes:
                    mode.__enter__()
                self._active.append((len(self._stack), modes))

        return hook

    def _leave(self, module: nn.Module, args: Any, out: Any) -> None:
        if self._active and self._active[-1][0] == len(self._stack):
            self._exit_modes()
        if self._stack:
            self._stack.pop()

    def compile(self, unit: nn.Module, example_inputs: Sequence[torch.Tensor], key: str) -> Callable[..., Any]:
        phase = unit_phase(key)

        def run(*inputs: torch.Tensor) -> Any:
            self._stack.clear()
            self._counts.clear()
            self._running = True
            self._phase = phase
            try:
                if self._everywhere:
                    with DecomposedSDPA(), _FaultMode(self):
                        return unit(*inputs)
                return unit(*inputs)
            finally:
                self._running = False
                while self._active:  # a forward that raised between a module's two hooks
                    self._exit_modes()

        return run

    def _exit_modes(self) -> None:
        for mode in reversed(self._active.pop()[1]):
            mode.__exit__(None, None, None)

    def run_op(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], site: OpSite) -> Any:
        for fault in self.faults:
            if fault.matches(site):
                return fault.apply(op, args, kwargs)
        return op(*args, **kwargs)

    def report(self) -> TargetReport:
        rep = super().report()
        for f in self.faults:
            where = f"table={f.table} min_position={f.min_position}" if f.kind == "table" else \
                f"param={f.param} expert={f.expert}" if f.kind == "weight" else \
                f"op={f.op} module={f.module} layer={f.layer} nth={f.nth} phase={f.phase} from_row={f.from_row}" + \
                (f" expert={f.expert}" if f.expert is not None else "")
            rep.notes.append(f"fault {f.kind} {where} value={f.value}: {f.hits} hit(s)")
        return rep


def _plant_table_fault(model: nn.Module, fault: Fault) -> None:
    """Wrap the model's own table builder (an instance attribute shadows the method) with the fault."""
    if fault.table == "rope":
        from firstlight.models.layers import rope_cos_sin

        build = model.rope_tables

        def rope_tables(positions: torch.Tensor, dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
            out = build(positions, dtype)
            bad = positions >= fault.min_position  # [B, S]
            if not bool(bad.any()):
                return out
            fault.hits += 1
            wrong = torch.where(bad, positions.float() * fault.value, positions.float())
            sel = bad[:, None, :, None]
            return {t: tuple(torch.where(sel, w, o) for w, o in
                             zip(rope_cos_sin(model.inv_freq[t].to(positions.device), wrong, dtype), out[t], strict=True))
                    for t in out}

        model.rope_tables = rope_tables
        return
    build_masks = model.masks

    def masks(positions: torch.Tensor, key_positions: torch.Tensor, allow_shortcuts: bool = False) -> dict[str, Any]:
        out = build_masks(positions, key_positions, allow_shortcuts)
        padded_rows = (positions < 0).any(-1)  # [B]
        no_key = key_positions < 0  # [B, L]
        if not bool(padded_rows.any() and no_key.any()):
            return out
        fault.hits += 1
        leak = (padded_rows[:, None] & no_key)[:, None, None, :]  # [B, 1, 1, L]
        return {t: (m | leak) if isinstance(m, torch.Tensor) else m for t, m in out.items()}

    model.masks = masks
