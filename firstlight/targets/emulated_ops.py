"""How each ATen op runs on an emulated chip: the kernels, the decompositions, the op classes.

Every op the dispatcher sees falls in one class:

    movement   views, copies, casts, masks, comparisons: no arithmetic, always lowered, never rounded
    matmul     aten.mm / aten.addmm: activations x weights, in the chip's `matmul` numerics
               aten.bmm / aten.baddbmm: activations x activations (attention), `attention_matmul`
    softmax    aten._softmax: max, exp (the chip's approximation), sum in fp32, reciprocal (approximation)
    approx     exp, reciprocal, rsqrt, sqrt, gelu, silu, sigmoid, tanh, log: the chip's vector-unit
               approximation named in `numerics.transcendentals` (exact when it names none)
    other      everything else: computed in fp32, the output held in the activation format

Inputs are rounded to the activation format before an op computes (a chip holds every tensor in
it), outputs after. A matmul quantizes its operands to their formats (weights once, cached by
storage and version), multiplies with the chip's fidelity and accumulates as its spec says
(`firstlight.numerics.matmul`). An op sent to the host computes in fp32 and its output is rounded
back to the activation format on return.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from firstlight.core.hardware import MatmulNumericsSpec
from firstlight.numerics import MatmulNumerics, approx, matmul, quantize
from firstlight.numerics.arithmetic import PreparedWeight, prepare_weight

aten = torch.ops.aten

# Ops with no arithmetic of their own: lowered everywhere, outputs not rounded.
MOVEMENT = frozenset({
    "aten.view", "aten._unsafe_view", "aten.reshape", "aten.t", "aten.transpose", "aten.permute", "aten.expand",
    "aten.slice", "aten.select", "aten.split", "aten.split_with_sizes", "aten.cat", "aten.stack", "aten.clone",
    "aten.contiguous", "aten.unsqueeze", "aten.squeeze", "aten._to_copy", "aten.copy_", "aten.copy", "aten.detach",
    "aten.alias", "aten.lift_fresh", "aten.lift_fresh_copy", "aten.ones", "aten.zeros", "aten.full", "aten.empty",
    "aten.new_empty", "aten.new_zeros", "aten.new_ones", "aten.new_full", "aten.arange", "aten.tril", "aten.triu",
    "aten.ge", "aten.gt", "aten.le", "aten.lt", "aten.eq", "aten.ne", "aten.bitwise_and", "aten.bitwise_or",
    "aten.bitwise_not", "aten.bitwise_and_", "aten.bitwise_or_", "aten.logical_not", "aten.logical_and",
    "aten.logical_or", "aten.all", "aten.any", "aten.equal", "aten._local_scalar_dense", "aten.unbind",
    "aten.flatten", "aten.zeros_like", "aten.ones_like", "aten.empty_like", "aten.full_like", "aten.fill_",
    "aten.fill", "aten.index", "aten.gather", "aten.unfold", "aten.narrow", "aten.as_strided", "aten.roll",
    "aten.flip", "aten.repeat", "aten.repeat_interleave", "aten.scalar_tensor", "aten.sym_size", "aten.max",
    "aten.argmax", "aten.topk", "aten.sort", "aten.isfinite", "aten.isnan", "aten.isinf", "aten.masked_fill_",
    "aten.sym_numel", "aten.sym_stride", "aten.dim", "aten.to", "aten.type_as", "aten.view_as", "aten.reshape_as",
    "aten.expand_as", "aten.movedim", "aten.swapaxes", "aten.chunk", "aten.tensor_split", "aten.pad", "aten.constant_pad_nd",
})


def is_movement(name: str) -> bool:
    """A movement op or its in-place form (aten.detach_, aten.unsqueeze_)."""
    return name in MOVEMENT or name.rstrip("_") in MOVEMENT


WEIGHT_MATMULS = frozenset({"aten.mm", "aten.addmm"})
ATTENTION_MATMULS = frozenset({"aten.bmm", "aten.baddbmm"})
# op packet -> name of the function in numerics.APPROX
APPROX_OPS = {"aten.exp": "exp", "aten.reciprocal": "reciprocal", "aten.rsqrt": "rsqrt", "aten.sqrt": "sqrt",
              "aten.gelu": "gelu", "aten.silu": "silu", "aten.sigmoid": "sigmoid", "aten.tanh": "tanh",
              "aten.log": "log"}


@functools.lru_cache(maxsize=4096)  # once per op object: it is asked on every dispatch
def packet(op: Any) -> str:
    """'aten.mm' for aten.mm.default (the name lowered_ops and overrides use)."""
    name = str(op)
    return name.rsplit(".", 1)[0] if name.count(".") >= 2 else name


@dataclass(frozen=True)
class SiteNumerics:
    """The numerics one op at one module computes in, after the spec and the overrides."""

    activation: str
    matmul: MatmulNumericsSpec  # this op's matmul (weight or attention), when it is one
    b_block_axis: int  # the axis weights' blocks run along: -2 (K, as MX) or -1 (N, Tenstorrent tiles)
    tile: tuple[int, int] | None
    impl: str | None  # transcendental approximation, when the op has one
    fallback: bool
    decompose: bool
    seed: int = 0


_HELD = "_firstlight_held_in"  # attribute naming the format a tensor's values are already held in


def round_to(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """x held in `fmt` (fp32 tensor of representable values); the common formats by casting.

    The result is marked with its format, so a tensor an emulated op produced is not rounded again
    when the next op reads it (rounding is idempotent; this only saves the work)."""
    if fmt == "fp32" or not x.is_floating_point() or getattr(x, _HELD, None) == fmt:
        return x
    if fmt == "bf16":
        out = x.to(torch.bfloat16).to(x.dtype)
    elif fmt == "fp16":
        out = x.to(torch.float16).to(x.dtype)
    else:
        out = quantize(x.float(), fmt).to(x.dtype)
    setattr(out, _HELD, fmt)
    return out


def carry_format(out: Any, args: tuple[Any, ...]) -> Any:
    """A movement op's output holds its input's values: it keeps the input's format mark."""
    src = next((a for a in args if isinstance(a, torch.Tensor)), None)
    fmt = getattr(src, _HELD, None) if src is not None else None
    if fmt is not None and isinstance(out, torch.Tensor) and out.is_floating_point():
        setattr(out, _HELD, fmt)
    return out


def _map(x: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(x, torch.Tensor):
        return fn(x) if x.is_floating_point() else x
    if isinstance(x, (tuple, list)):
        return type(x)(_map(v, fn) for v in x)
    return x


def quantize_operand(x: torch.Tensor, fmt: str, axis: int, scaling: str | None) -> torch.Tensor:
    if scaling is None:
        return round_to(x, fmt) if fmt in ("fp32", "bf16", "fp16") else quantize(x.float(), fmt, axis=axis)
    return quantize(x.float(), fmt, axis=axis, scaling=scaling)


class WeightCache:
    """Weights prepared once (quantized, padded, fidelity-split) per storage, version, view and numerics.

    Only the prepared model's own parameters are cached (`pin`): their storage outlives the cache,
    so a pointer can never be reused by another tensor. Anything else is prepared on every call.
    """

    def __init__(self) -> None:
        self._cache: dict[tuple[Any, ...], PreparedWeight] = {}
        self._pinned: dict[int, torch.Tensor] = {}  # storage pointer -> a parameter holding it alive
        self._rounded: dict[tuple[Any, ...], torch.Tensor] = {}  # parameters rounded to an activation format

    def pin(self, params: Any) -> None:
        for p in params:
            self._pinned[p.untyped_storage().data_ptr()] = p

    def get(self, w: torch.Tensor, spec: MatmulNumericsSpec, axis: int, num: MatmulNumerics) -> PreparedWeight:
        ptr = w.untyped_storage().data_ptr()
        key = (ptr, w.storage_offset(), tuple(w.shape), w.stride(), w._version, spec.b_format, spec.b_scaling, axis,
               num.fidelity, num.tile)
        hit = self._cache.get(key) if ptr in self._pinned else None
        if hit is None:
            q = quantize_operand(w, spec.b_format, axis, spec.b_scaling)
            hit = prepare_weight(q.float(), num, b_axis=axis)
            if ptr in self._pinned:
                self._cache[key] = hit
        return hit

    def held(self, args: Any, fmt: str) -> Any:
        """`args` with the model's own parameters replaced by copies rounded to `fmt` once (an embedding
        table or a norm weight read by an elementwise op), so they are not rounded again on every call."""
        def one(t: torch.Tensor) -> torch.Tensor:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in self._pinned or fmt == "fp32" or getattr(t, _HELD, None) == fmt:
                return t
            key = (ptr, t.storage_offset(), tuple(t.shape), t.stride(), t._version, fmt)
            hit = self._rounded.get(key)
            if hit is None:
                hit = self._rounded[key] = round_to(t, fmt)
            return hit

        return _map(args, one)


def run_matmul(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], cfg: SiteNumerics,
               weights: WeightCache) -> torch.Tensor:
    """aten.mm(a, b) / addmm(bias, a, b, beta, alpha) / bmm(a, b) / baddbmm in the site's numerics.

    Operands are quantized here (blocks of `a` along K; of a weight `b` along `cfg.b_block_axis`,
    of an activation `b` along K), then `numerics.matmul` multiplies them with the chip's fidelity
    and accumulates in its accumulator. A weight is prepared once (WeightCache).
    """
    if name in ("aten.addmm", "aten.baddbmm"):
        bias, a, b = args[:3]
        beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
    else:
        (a, b), bias, beta, alpha = args[:2], None, 1, 1
    spec = cfg.matmul
    num = MatmulNumerics(fidelity=spec.fidelity, accumulator=spec.accumulator,
                         promotion_interval=spec.promotion_interval, rounding=spec.rounding,
                         seed=cfg.seed if spec.rounding == "stochastic" else None, tile=cfg.tile, mma_k=spec.mma_k)
    a = quantize_operand(a, spec.a_format, -1, spec.a_scaling)
    if name in WEIGHT_MATMULS:
        out = matmul(a.float(), weights.get(b, spec, cfg.b_block_axis, num), num)
    else:
        out = matmul(a.float(), quantize_operand(b, spec.b_format, -2, spec.b_scaling).float(), num)
    if alpha != 1:
        out = out * alpha
    if bias is not None:
        bias = round_to(bias, cfg.activation).float()
        out = out + (bias if beta == 1 else beta * bias)
    return round_to(out, cfg.activation)


def run_softmax(x: torch.Tensor, dim: int, exp_impl: str, recip_impl: str, fmt: str) -> torch.Tensor:
    """softmax as a fused chip kernel: max, exp (approximation), fp32 sum, reciprocal (approximation)."""
    x = x.float()
    m = x.amax(dim, keepdim=True)
    shifted = x - m
    e = round_to(approx("exp", exp_impl)(shifted), fmt)
    e = torch.where(torch.isneginf(shifted), torch.zeros_like(e), e)  # masked positions are exact zeros
    s = e.sum(dim, keepdim=True)
    return round_to(e * approx("reciprocal", recip_impl)(s), fmt)


def run_approx(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], impl: str, fmt: str) -> torch.Tensor:
    fn = approx(APPROX_OPS[name], impl)
    x = args[0].float()
    if name == "aten.gelu" and impl == "exact":
        return round_to(aten.gelu.default(x, approximate=kwargs.get("approximate", "none")), fmt)
    return round_to(fn(x), fmt)


# ---- decompositions: an op the compiler lacks, spelled in ops it has ---------------------------
Call = Callable[..., torch.Tensor]  # call(op_overload, *args): one emulated sub-op


def _rsqrt(call: Call, x: torch.Tensor) -> torch.Tensor:
    return call(aten.reciprocal.default, call(aten.sqrt.default, x))


def _sigmoid(call: Call, x: torch.Tensor) -> torch.Tensor:
    return call(aten.reciprocal.default, call(aten.add.Scalar, call(aten.exp.default, call(aten.neg.default, x)), 1.0))


def _silu(call: Call, x: torch.Tensor) -> torch.Tensor:
    return call(aten.mul.Tensor, x, _sigmoid(call, x))


def _tanh(call: Call, x: torch.Tensor) -> torch.Tensor:  # tanh(x) = 2 sigmoid(2x) - 1
    return call(aten.sub.Scalar, call(aten.mul.Scalar, _sigmoid(call, call(aten.mul.Scalar, x, 2.0)), 2.0), 1.0)


def _gelu(call: Call, x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    if approximate == "tanh":  # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))  (Hendrycks & Gimpel 2016)
        inner = call(aten.mul.Scalar, call(aten.add.Tensor, x, call(aten.mul.Scalar, call(aten.pow.Tensor_Scalar, x, 3),
                                                                   0.044715)), 0.7978845608028654)
        t = call(aten.tanh.default, inner)
    else:  # 0.5 x (1 + erf(x / sqrt 2))
        t = call(aten.erf.default, call(aten.mul.Scalar, x, 0.7071067811865476))
    return call(aten.mul.Tensor, call(aten.mul.Scalar, x, 0.5), call(aten.add.Scalar, t, 1.0))


def _softmax(call: Call, x: torch.Tensor, dim: int, half_to_float: bool = False) -> torch.Tensor:
    e = call(aten.exp.default, call(aten.sub.Tensor, x, call(aten.amax.default, x, [dim], True)))
    return call(aten.mul.Tensor, e, call(aten.reciprocal.default, call(aten.sum.dim_IntList, e, [dim], True)))


def _reciprocal(call: Call, x: torch.Tensor) -> torch.Tensor:
    return call(aten.div.Tensor, torch.ones_like(x), x)


def _mean(call: Call, x: torch.Tensor, dim: Any = None, keepdim: bool = False, dtype: Any = None) -> torch.Tensor:
    dims = list(range(x.ndim)) if dim is None else list(dim)
    n = 1
    for d in dims:
        n *= x.shape[d]
    return call(aten.mul.Scalar, call(aten.sum.dim_IntList, x, dims, keepdim), 1.0 / n)


DECOMPOSITIONS: dict[str, Callable[..., torch.Tensor]] = {
    "aten.rsqrt": _rsqrt, "aten.sigmoid": _sigmoid, "aten.silu": _silu, "aten.tanh": _tanh, "aten.gelu": _gelu,
    "aten._softmax": _softmax, "aten.reciprocal": _reciprocal, "aten.mean": _mean,
}


def round_inputs(args: Any, fmt: str) -> Any:
    return _map(args, lambda t: round_to(t, fmt))
