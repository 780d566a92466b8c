"""The Target contract: turn a loaded model into something that runs, and say what it did.

The verification harness drives a target through four calls, in this order:

    target = SomeTarget(dtype=torch.bfloat16, **options)   # options: strings from the command line
    model = target.prepare(model)                          # once; model already cast to target.dtype
    fn = target.compile(unit, example_inputs, key)         # per unit (whole model, embedding, layer, head)
    out = fn(*example_inputs)                              # inputs already hold the unit's parameters
    y = target.run_op(op, args, kwargs, site)              # per ATen op, only when localizing a fault
    target.report()                                        # what was lowered, what fell back

A *unit* is a `torch.nn.Module` whose forward takes tensors only and returns a tensor or a tuple of
tensors; its parameters are passed as trailing inputs (so a compiled artifact for one layer serves
every layer with the same `key`: same structure, different weights). `compile` must return a
callable accepting inputs of the same shapes and dtypes as `example_inputs`. Keys: `logits` (whole
model), `embed`, `layer:<type>`, `head`, and, for targets without hooks, `attn:<type>` and `mlp`
(a layer's attention and MLP on their own, so they are compared inside the layer too; `attn:<type>`
is the layer's token mixer whatever it is, attention or, for a recurrent layer type, Gated DeltaNet
or Mamba-2, which ignore the tables; a layer without `mlp` has `block_sparse_moe` and
`shared_mlp` units instead, Granite 4.0-H; a Nemotron-H MLP or MoE block has one FFN unit,
`mixer:mlp` or `mixer:moe`, and no `attn:<type>`).

A compiled unit must be deterministic: called twice with the same input bits it returns the same
output bits. The harness relies on it to skip re-running a layer in isolation when its propagated
input already equals the reference input bit for bit. A target with `supports_hooks` must run
the whole model's layers as it runs the layer units.

`run_op` executes one ATen op of an FX graph in the target's numerics; the default runs it in
PyTorch eagerly. A target for an emulated chip overrides it to use its own kernels, so that the
harness can replay a failing layer op by op on the target.

Serving-path units (extension, backward compatible: a target that only knows the keys above runs
them unchanged, since they are plain tensor-in/tensor-out modules like every other unit; the
adapters are in firstlight/verify/units.py):

    key              inputs (then the parameters)                        outputs
    tables           positions [B, S], key_positions [B, L]              per layer type, sorted: cos, sin
                                                                          [B, 1, S, D] (target dtype),
                                                                          mask [B, 1, S, L] (bool)
    prefill          ids [B, S], positions [B, S], write_slots [B*S],    logits [B, S, V],
                     gather_slots [B, L], key_positions [B, L],          kv' (kv with the new K/V
                     kv [num_layers, 2, num_slots, Hkv, D]               written at write_slots)
    decode           the same with S = 1                                 the same
    decode_layer:<type>  x [B, S, E], cos, sin, mask, write_slots,       x' [B, S, E], kv_layer'
                     gather_slots, kv_layer [2, num_slots, Hkv, D]
                     (a recurrent layer type: x, cos, sin, mask,          x', conv', rec'
                     state_slots [B], conv, rec [num_state_slots, ...])

A hybrid model's `prefill` / `decode` take three more inputs after kv, state_slots [B] (each row's
recurrent state slot), conv [num_state_layers, num_state_slots, C, K-1] and rec [num_state_layers,
num_state_slots, ...] (the engine's per-request states: models/states.py `state_shapes`), and return conv'
and rec' after kv'.

`prefill` / `decode` are a whole forward through a paged KV cache, as a server runs it: the
model's KV-cache protocol (firstlight/models/kv_cache.py) over a pool of slots, each row's keys
gathered through its block table (`gather_slots`), new K/V scattered to `write_slots` (padding
tokens write to a scratch slot), `key_positions` -1 where a slot holds no key. The unit is
functional: it returns the updated pool instead of writing into its input, so a compiler can
treat it like any other graph. Chunked prefill and batches of prompts of different lengths are
`prefill` calls with several rows and padding (position -1). `tables` builds what the model
builds once per forward (rotary cos/sin, attention masks) so verify can compare the target's
tables with the reference's and feed the layer units the reference's.

When a decode step is localized, its embedding and head run as units `decode_embed` and
`decode_head` (the `embed` / `head` signatures). `unit_phase(key)` is "decode" for every key
that starts with `decode`, else "prefill"; it is also
`OpSite.phase` during op replay, so a target can compile (or a fault can select) decode
differently from prefill, as real stacks do (different kernels for one-token steps).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from firstlight.errors import FirstlightError


class TargetError(FirstlightError):
    """A target that could not be built, compiled or run: the verification could not run (exit 2)."""

    exit_code = 2


class OpNotLoweredError(TargetError):
    """An op the target's compiler does not lower, found at compile time (what, where, which model line)."""

    def __init__(self, message: str, op: str, module: str, line: str | None) -> None:
        super().__init__(message)
        self.op, self.module, self.line = op, module, line


@dataclass(frozen=True)
class OpSite:
    """Where an ATen op sits in the model: innermost module path, layer index, n-th call there."""

    module: str
    layer: int | None
    nth: int
    op: str  # e.g. "aten.rsqrt.default"
    phase: str = "prefill"  # "prefill" | "decode": the phase of the unit being run (see unit_phase)


@dataclass
class TargetReport:
    name: str
    dtype: str
    ops_lowered: dict[str, int] = field(default_factory=dict)
    ops_fallback: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)  # target-specific: e.g. an emulated chip's predicted times

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "ops_lowered": dict(sorted(self.ops_lowered.items())),
                "ops_fallback": dict(sorted(self.ops_fallback.items())), "notes": list(self.notes),
                **({"details": self.details} if self.details else {})}


class Target:
    """Base class of every target; the defaults run the model eagerly in `dtype`."""

    name: ClassVar[str] = "custom"
    # True when module forward hooks fire inside compiled units (eager execution), so the harness
    # can capture attention/MLP outputs inside a layer; compiled targets expose layer outputs only.
    supports_hooks: ClassVar[bool] = True

    def __init__(self, dtype: torch.dtype = torch.float32, **options: str) -> None:
        if options:
            raise TargetError(
                f"target '{self.name}' takes no options, got: {', '.join(sorted(options))}"
            )
        self.dtype = dtype

    @property
    def tolerance_dtype(self) -> torch.dtype:
        """The precision results are judged at: the dtype the target computes in. An emulated chip
        holds fp32 tensors of bf16 values, so it sets bfloat16 here while `dtype` stays float32."""
        return self.__dict__.get("_tolerance_dtype", self.dtype)

    @tolerance_dtype.setter
    def tolerance_dtype(self, value: torch.dtype) -> None:
        self.__dict__["_tolerance_dtype"] = value

    def prepare(self, model: nn.Module) -> nn.Module:
        return model

    def compile(self, unit: nn.Module, example_inputs: Sequence[torch.Tensor], key: str) -> Callable[..., Any]:
        return unit

    def run_op(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], site: OpSite) -> Any:
        return op(*args, **kwargs)

    def report(self) -> TargetReport:
        return TargetReport(name=self.name, dtype=str(self.dtype).removeprefix("torch."))


def unit_phase(key: str) -> str:
    """'decode' for a decode-step unit key (`decode`, `decode_layer:<type>`, `decode_embed`, ...), else 'prefill'."""
    return "decode" if key.split(":", 1)[0].startswith("decode") else "prefill"


@functools.lru_cache(maxsize=4096)  # once per op object: dispatch modes ask on every call
def op_name(op: Any) -> str:
    """'aten.rsqrt.default' for an OpOverload; the Python name for anything else."""
    if isinstance(op, torch._ops.OpOverload):
        return str(op)
    return getattr(op, "__name__", str(op))
