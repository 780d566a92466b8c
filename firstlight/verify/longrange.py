"""Perplexity through the target's compiled `logits` unit, judged on both sides, scored per position.

The target side is the same compiled `logits` unit (key `logits`) the teacher-forced parity uses,
called on each window (eval/ppl.py's strided windows): no second code path, so every kernel the
target's whole-model forward runs is exercised here too, at the window's length (a `faulty` op is
hit here as in the parity pass; `test_perplexity_runs_the_targets_logits_unit`). Both sides keep
every token's NLL and the KL of its next-token distribution, so a failing perplexity says where
the two start to differ: the first scored token whose KL is over `max_mean_kl` (or non-finite),
its window and its position inside that window's forward.

Perplexity is judged on both sides: a target can be "better" than its reference only by being
different (a flatter or sharper distribution than the reference's), so ratio < 1 / max_ppl_ratio
is a mismatch too. The per-token KL over the whole stream is judged like the teacher-forced
parity's (mean <= `max_mean_kl`): on a random or small model, errors of both signs can cancel in
the perplexity, not in the KL.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from firstlight.eval.ppl import windows
from firstlight.verify.tolerance import LogitTolerance


def perplexity_check(ref_fn: Callable[[torch.Tensor], torch.Tensor], tgt_fn: Callable[[torch.Tensor], torch.Tensor],
                     ids: list[int], window: int, stride: int, tol: LogitTolerance) -> dict[str, Any]:
    """Both perplexities over `ids`, their ratio, the verdict and the first divergent token."""
    tokens = torch.tensor([ids])
    nll_r, nll_t, kls, where = [], [], [], []  # where: (token index, window begin, window end)
    for begin, end, first in windows(len(ids), window, stride):
        chunk = tokens[:, begin:end]
        r = ref_fn(chunk).float()[0]
        t = tgt_fn(chunk).float()[0]
        rows = slice(first - begin - 1, end - begin - 1)  # logits row p predicts token p + 1
        target = tokens[0, first:end]
        r_lp, t_lp = F.log_softmax(r[rows].double(), -1), F.log_softmax(t[rows].double(), -1)
        nll_r.append(-r_lp.gather(-1, target[:, None]).squeeze(-1))
        nll_t.append(-t_lp.gather(-1, target[:, None]).squeeze(-1))
        kl = (r_lp.exp() * (r_lp - t_lp)).sum(-1)
        kls.append(torch.where(torch.isfinite(t[rows]).all(-1), kl, torch.full_like(kl, math.inf)))
        where += [(q, begin, end) for q in range(first, end)]
    nr, nt, kl = torch.cat(nll_r), torch.cat(nll_t), torch.cat(kls)
    ppl_r, ppl_t = math.exp(float(nr.mean())), _exp(float(nt.mean()))
    ratio = ppl_t / ppl_r if math.isfinite(ppl_t) else math.nan
    lo, hi = 1.0 / tol.max_ppl_ratio, tol.max_ppl_ratio
    ratio_ok = math.isfinite(ratio) and lo <= ratio <= hi
    mean_kl = float(kl.mean())
    kl_ok = mean_kl <= tol.max_mean_kl  # False for NaN / inf
    out: dict[str, Any] = {
        "num_tokens": len(where), "window": window, "stride": stride, "unit": "logits",
        "reference": ppl_r, "target": ppl_t if math.isfinite(ppl_t) else None,
        "ratio": ratio if math.isfinite(ratio) else None, "allowed_ratio": [lo, hi],
        "ratio_ok": ratio_ok, "kl_ok": kl_ok, "ok": ratio_ok and kl_ok,
        "direction": None if ratio_ok else ("non-finite" if not math.isfinite(ratio) else
                                            ("lower" if ratio < lo else "higher")),
        "mean_kl": _finite(mean_kl), "max_kl": _finite(float(kl.max())), "kl_limit": tol.max_mean_kl,
        "first_divergence": None,
    }
    over = ((kl > tol.max_mean_kl) | ~torch.isfinite(kl)).nonzero().flatten().tolist()
    if over:
        k = over[0]
        q, begin, end = where[k]
        out["first_divergence"] = {
            "token_index": q, "window": [begin, end], "position": q - 1 - begin,
            "kl": _finite(float(kl[k])), "nll_reference": float(nr[k]), "nll_target": _finite(float(nt[k])),
            "num_tokens_over": len(over), "kl_limit": tol.max_mean_kl,
        }
    return out


def _exp(x: float) -> float:
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None
