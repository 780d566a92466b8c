"""Approximate transcendentals: each within the error its docstring states, and measurably not exact."""

from __future__ import annotations

import math

import pytest
import torch

from firstlight.numerics import NumericsError, quantize
from firstlight.numerics.transcendentals import APPROX, approx

OPS = ("exp", "reciprocal", "rsqrt", "sqrt", "gelu", "sigmoid", "silu", "tanh", "log")


def lin(a: float, b: float) -> torch.Tensor:
    return torch.linspace(a, b, 100001)


def logs(a: float, b: float) -> torch.Tensor:
    return torch.logspace(a, b, 100001)


# (op, impl, inputs, "rel" | "abs", documented max error, an error it must exceed: it is an approximation)
CASES = [
    ("exp", "tt_approx", lin(-42, 44), "rel", 0.062, 0.03),
    ("exp", "schraudolph", lin(-86, 88), "rel", 0.034, 0.01),
    ("exp", "tt_accurate", lin(-1, 1), "rel", 0.013, 1e-3),
    ("exp", "tt_accurate", lin(-4, 4), "rel", 0.039, 0.013),
    ("exp", "range_poly3", lin(-80, 80), "rel", 8.1e-4, 1e-4),
    ("reciprocal", "newton1", logs(-30, 30), "rel", 2.6e-3, 1e-4),
    ("reciprocal", "newton2", logs(-30, 30), "rel", 6.7e-6, 1e-7),
    ("rsqrt", "quake1", logs(-30, 30), "rel", 1.8e-3, 1e-4),
    ("rsqrt", "quake2", logs(-30, 30), "rel", 4.8e-6, 1e-7),
    ("sqrt", "rsqrt_newton", logs(-30, 30), "rel", 4.8e-6, 1e-7),
    ("log", "poly3", logs(-30, 30), "abs", 5.5e-4, 1e-4),
    ("gelu", "tanh", lin(-10, 10), "abs", 4.8e-4, 1e-4),
    ("gelu", "tt_lut", lin(-10, 10), "abs", 0.024, 0.01),
    ("sigmoid", "exp_approx", lin(-20, 20), "abs", 0.015, 1e-3),
    ("silu", "exp_approx", lin(-20, 20), "rel", 0.059, 0.01),
    ("tanh", "exp_approx", lin(-10, 10), "abs", 0.030, 1e-3),
]


@pytest.mark.parametrize(("op", "impl", "x", "kind", "bound", "floor"), CASES, ids=lambda v: v if isinstance(v, str) else "")
def test_error_is_within_the_documented_bound_and_not_zero(
    op: str, impl: str, x: torch.Tensor, kind: str, bound: float, floor: float
) -> None:
    ref = APPROX[op]["exact"](x.double())
    err = (approx(op, impl)(x).double() - ref).abs()
    if kind == "rel":
        err = err / ref.abs()
    assert floor < err.max().item() <= bound


def test_every_op_has_exact_and_exact_is_torch() -> None:
    assert set(APPROX) == set(OPS)
    x = torch.linspace(0.1, 3, 50)
    for op in OPS:
        assert torch.equal(approx(op, "exact")(x), APPROX[op]["exact"](x))
        assert len(APPROX[op]) >= 2


def test_schraudolph_gives_bf16_values_and_tt_approx_never_undershoots() -> None:
    x = lin(-40, 40)
    s = approx("exp", "schraudolph")(x)
    assert torch.equal(quantize(s, "bf16"), s)
    t = approx("exp", "tt_approx")(x)
    # linear interpolation of a convex curve, up to the 2^-16 fixed-point step of x / ln2
    assert (t.double() >= torch.exp(x.double()) * (1 - 2.0**-16)).all()


def test_exp_saturation_and_special_inputs() -> None:
    t = approx("exp", "tt_approx")(torch.tensor([-50.0, 0.0, 1.0, 90.0]))
    assert t.tolist()[:2] == [0.0, 1.0] and t[3].item() == math.inf
    assert abs(t[2].item() - 2 * 1.442695) < 1e-4  # 2^floor(x/ln2) (1 + frac(x/ln2)): linear between powers of 2
    assert approx("exp", "schraudolph")(torch.tensor([-200.0])).item() < 1e-37  # clamped at -86.6
    acc = approx("exp", "tt_accurate")(torch.tensor([0.0, -1.0, 1.0]))
    assert acc[0].item() == 1.0 and abs(acc[1].item() * acc[2].item() - 1) < 1e-4
    assert torch.isinf(approx("log", "poly3")(torch.tensor([0.0]))).all()
    assert torch.isnan(approx("log", "poly3")(torch.tensor([-1.0]))).all()
    assert approx("sqrt", "rsqrt_newton")(torch.tensor([0.0])).item() == 0.0


def test_reciprocal_keeps_the_sign() -> None:
    x = torch.tensor([-4.0, -0.5, 0.25, 3.0])
    for impl in ("newton1", "newton2"):
        assert torch.allclose(approx("reciprocal", impl)(x), 1 / x, rtol=3e-3)


def test_tt_gelu_lut_is_exact_beyond_three_and_piecewise_linear() -> None:
    x = torch.tensor([3.5, 10.0, -3.5, -10.0])
    assert approx("gelu", "tt_lut")(x).tolist() == [3.5, 10.0, 0.0, 0.0]
    a = torch.tensor([0.6, 0.7, 0.8])  # inside one segment: second difference is zero
    y = approx("gelu", "tt_lut")(a)
    assert abs((y[2] - y[1]) - (y[1] - y[0])).item() < 1e-6


def test_unknown_op_or_impl_names_the_known_ones() -> None:
    with pytest.raises(NumericsError, match="unknown transcendental op 'erf'.*exp"):
        approx("erf", "exact")
    with pytest.raises(NumericsError, match="unknown implementation 'lut' of exp.*schraudolph"):
        approx("exp", "lut")
