"""Error metrics of one tensor against its reference, and the pass/fail test of a tolerance.

max_abs   max |t - r|                      rel_l2   ||t - r|| / ||r||
cosine    <t, r> / (||t|| ||r||)           pcc      Pearson correlation of the flattened tensors
max_ulp   max distance in units in the last place of the target dtype (r rounded to that dtype)
frac_beyond  fraction of elements with |t - r| > atol_rms * rms(r) + rtol * |r|
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

from firstlight.verify.tolerance import Tolerance

_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


@dataclass
class TensorMetrics:
    max_abs: float
    rel_l2: float
    cosine: float
    pcc: float
    max_ulp: float
    frac_beyond: float
    numel: int
    ok: bool

    def to_dict(self) -> dict[str, Any]:
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(self).items()}


def ulp_distance(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """|a - b| in ULPs of `dtype`: both rounded to dtype, compared on the ordered integer line."""
    int_dtype = _INT_VIEW.get(dtype)
    if int_dtype is None:
        return (a.double() - b.double()).abs()

    def ordered(x: torch.Tensor) -> torch.Tensor:
        bits = x.to(dtype).contiguous().view(int_dtype).long()
        sign = 1 << (torch.finfo(dtype).bits - 1)
        return torch.where(bits < 0, -(bits & (sign - 1)), bits)

    dist = (ordered(a) - ordered(b)).abs().double()
    return torch.where(torch.isfinite(a) & torch.isfinite(b), dist, torch.full_like(dist, math.inf))


def compare(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, tol: Tolerance) -> TensorMetrics:
    """Metrics of `out` against `ref` (any dtypes; computed in float64) and whether `tol` holds."""
    if out.shape != ref.shape:
        return TensorMetrics(math.inf, math.inf, math.nan, math.nan, math.inf, 1.0, ref.numel(), False)
    if not ref.is_floating_point():
        mismatch = (out != ref).double().mean().item() if ref.numel() else 0.0
        return TensorMetrics(float((out.long() - ref.long()).abs().max().item()) if ref.numel() else 0.0,
                             mismatch, math.nan, math.nan, 0.0, mismatch, ref.numel(), mismatch == 0.0)
    t, r = out.detach().double().flatten(), ref.detach().double().flatten()
    if r.numel() == 0:
        return TensorMetrics(0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0, True)
    diff = torch.where(t == r, torch.zeros_like(t), t - r)  # inf == inf counts as exact
    max_abs = diff.abs().max().item()  # inf where one side is non-finite and the other is not
    r_fin = torch.where(torch.isfinite(r), r, torch.zeros_like(r))
    norm_r = r_fin.norm().item()
    norm_d = diff.norm().item()
    rel_l2 = norm_d / norm_r if norm_r > 0 else (0.0 if norm_d == 0 else math.inf)
    t_fin = torch.where(torch.isfinite(t), t, torch.zeros_like(t))
    denom = t_fin.norm().item() * norm_r
    cosine = (t_fin @ r_fin).item() / denom if denom > 0 else (1.0 if norm_d == 0 else 0.0)
    tc, rc = t_fin - t_fin.mean(), r_fin - r_fin.mean()
    pden = tc.norm().item() * rc.norm().item()
    pcc = (tc @ rc).item() / pden if pden > 0 else (1.0 if norm_d == 0 else 0.0)
    max_ulp = ulp_distance(out.detach().flatten(), ref.detach().flatten(), dtype).max().item()
    rms = norm_r / math.sqrt(r.numel())
    bound = tol.atol_rms * rms + tol.rtol * r_fin.abs()
    beyond = (diff.abs() > bound) | torch.isnan(diff)
    frac = beyond.double().mean().item()
    ok = frac <= tol.max_frac_beyond and rel_l2 <= tol.max_rel_l2
    return TensorMetrics(max_abs, rel_l2, cosine, pcc, max_ulp, frac, r.numel(), ok)
