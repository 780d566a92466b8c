"""Error metrics of one tensor against its reference, and the pass/fail test of a tolerance.

max_abs   max |t - r|                      rel_l2   ||t - r|| / ||r||
cosine    <t, r> / (||t|| ||r||)           pcc      Pearson correlation of the flattened tensors
max_ulp   max distance in units in the last place of the target dtype (r rounded to that dtype)
frac_beyond  fraction of elements with |t - r| > atol_rms * rms(r) + rtol * |r|
nonfinite    elements that are NaN or inf in the target where the reference is finite (where a
             NaN is born: the report names the first tensor and op with nonfinite > 0)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
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
    nonfinite: int = 0

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


def _dot(a: np.ndarray, b: np.ndarray) -> float:
    # einsum, not `@`: numpy's dot goes to a threaded BLAS, which fights torch's pool for the cores
    return float(np.einsum("i,i->", a, b))


def _np32(x: torch.Tensor) -> np.ndarray:
    """A CPU float tensor as a numpy float32/float64 array without a torch kernel (bf16 by bit shift)."""
    if x.dtype == torch.bfloat16:
        return (x.view(torch.int16).numpy().view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if x.dtype in (torch.float32, torch.float64, torch.float16):
        return x.numpy()
    return x.double().numpy()


def _round_bits(a: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """Bits (int16/int32) of `a` rounded to nearest-even in `dtype`."""
    if dtype == torch.float32:
        return a.astype(np.float32, copy=False).view(np.int32)
    if dtype == torch.float16:
        return a.astype(np.float16).view(np.int16)
    u = a.astype(np.float32).view(np.uint32).astype(np.uint64)  # bfloat16: the top half, rounded
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = np.isnan(a)
    if nan.any():
        rounded = np.where(nan, 0x7FC0, rounded)
    return rounded.astype(np.uint16).view(np.int16)


def _max_ulp(t: np.ndarray, r: np.ndarray, dtype: torch.dtype, finite: bool) -> float:
    """Max distance in ULPs of `dtype` (both rounded to it, on the ordered integer line)."""
    if dtype not in _INT_VIEW:
        return float(np.abs(t - r).max())
    sign = 1 << (torch.finfo(dtype).bits - 1)

    def ordered(x: np.ndarray) -> np.ndarray:
        bits = _round_bits(x, dtype).astype(np.int64)
        return np.where(bits < 0, -(bits & (sign - 1)), bits)

    dist = np.abs(ordered(t) - ordered(r))
    if not finite and not (np.isfinite(t) & np.isfinite(r)).all():
        return math.inf
    return float(dist.max())


def _pcc(t: np.ndarray, r: np.ndarray, tt: float, rr: float, tr: float, mean_t: float, mean_r: float,
         norm_d: float) -> float:
    """Pearson correlation from the sums already taken; centered explicitly when the mean dominates."""
    n = t.size
    var_t, var_r = tt - n * mean_t * mean_t, rr - n * mean_r * mean_r
    if var_t > 1e-6 * tt and var_r > 1e-6 * rr:  # cancellation costs at most ~1e-10 here
        return (tr - n * mean_t * mean_r) / math.sqrt(var_t * var_r)
    tc, rc = t - mean_t, r - mean_r
    pden = math.sqrt(_dot(tc, tc) * _dot(rc, rc))
    return _dot(tc, rc) / pden if pden > 0 else (1.0 if norm_d == 0 else 0.0)


def compare(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, tol: Tolerance) -> TensorMetrics:
    """Metrics of `out` against `ref` (any dtypes; computed in float64) and whether `tol` holds.

    Computed with numpy, single-threaded: the harness compares hundreds of small tensors, and
    torch's intra-op pool costs more in synchronization than it saves on them (10-20x slower
    with 2 threads on a loaded 2-core machine, see docs/VERIFY.md).
    """
    if out.shape != ref.shape:
        return TensorMetrics(math.inf, math.inf, math.nan, math.nan, math.inf, 1.0, ref.numel(), False)
    if not ref.is_floating_point():
        mismatch = (out != ref).double().mean().item() if ref.numel() else 0.0
        return TensorMetrics(float((out.long() - ref.long()).abs().max().item()) if ref.numel() else 0.0,
                             mismatch, math.nan, math.nan, 0.0, mismatch, ref.numel(), mismatch == 0.0)
    if ref.numel() == 0:
        return TensorMetrics(0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0, True)
    if out.dtype == ref.dtype and torch.equal(out, ref):  # same bits (NaN != NaN: those take the long way)
        return TensorMetrics(0.0, 0.0, 1.0, 1.0, 0.0, 0.0, ref.numel(), True)
    t_raw, r_raw = _np32(out.detach().cpu().reshape(-1)), _np32(ref.detach().cpu().reshape(-1))
    t, r = t_raw.astype(np.float64), r_raw.astype(np.float64)
    n = r.size
    sum_t, sum_r = float(t.sum()), float(r.sum())
    finite = math.isfinite(sum_t) and math.isfinite(sum_r)  # an inf or NaN anywhere makes its sum one
    with np.errstate(invalid="ignore", over="ignore"):
        if finite:
            diff, t_fin, r_fin = t - r, t, r
        else:
            diff = np.where(t == r, 0.0, t - r)  # inf == inf counts as exact
            t_fin, r_fin = np.where(np.isfinite(t), t, 0.0), np.where(np.isfinite(r), r, 0.0)
            sum_t, sum_r = float(t_fin.sum()), float(r_fin.sum())
    dd, tt, rr, tr = _dot(diff, diff), _dot(t_fin, t_fin), _dot(r_fin, r_fin), _dot(t_fin, r_fin)
    abs_diff = np.abs(diff, out=diff)
    max_abs = float(abs_diff.max())  # inf where one side is non-finite and the other is not
    norm_r, norm_d = math.sqrt(rr), math.sqrt(dd)
    rel_l2 = norm_d / norm_r if norm_r > 0 else (0.0 if norm_d == 0 else math.inf)
    denom = math.sqrt(tt) * norm_r
    cosine = tr / denom if denom > 0 else (1.0 if norm_d == 0 else 0.0)
    pcc = _pcc(t_fin, r_fin, tt, rr, tr, sum_t / n, sum_r / n, norm_d)
    max_ulp = _max_ulp(t_raw, r_raw, dtype, finite)
    rms = norm_r / math.sqrt(n)
    bound = np.abs(r_fin)
    bound *= tol.rtol
    bound += tol.atol_rms * rms
    with np.errstate(invalid="ignore"):
        num_beyond = int(np.count_nonzero(abs_diff > bound)) + (0 if finite else int(np.count_nonzero(np.isnan(diff))))
    frac = num_beyond / n
    ok = frac <= tol.max_frac_beyond and rel_l2 <= tol.max_rel_l2  # False for a NaN rel_l2
    nonfinite = 0 if finite else int(np.count_nonzero(~np.isfinite(t) & np.isfinite(r)))
    return TensorMetrics(max_abs, rel_l2, cosine, pcc, max_ulp, frac, n, ok, nonfinite)
