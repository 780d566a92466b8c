"""Logit parity: teacher-forced per-position agreement, free-running greedy divergence, perplexity.

Teacher-forced: both sides read the same tokens (the reference's greedy continuation of the
prompt), so errors do not compound. Free-running greedy needs no target generation: the target's
greedy run equals the reference's up to the first position where the target's argmax on that
shared prefix differs from the reference token, which the teacher-forced logits already show.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from firstlight.verify.tolerance import LogitTolerance


@dataclass
class ParityResult:
    num_positions: int
    top1_agreement: float
    topk_overlap: float
    mean_kl: float
    max_kl: float
    max_logprob_error: float
    mean_logprob_error: float
    disagreements: list[dict[str, Any]]  # per top-1 flip: position, ref/target token, ref margin, near_tie
    first_divergence: dict[str, Any] | None  # free-running greedy, in the generated part
    ok: bool
    reasons: list[str]
    nonfinite_positions: int = 0  # positions whose target logits hold a NaN / inf

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@torch.no_grad()
def teacher_forced(
    ref_logits: torch.Tensor, tgt_logits: torch.Tensor, tokens: list[int], prompt_len: int, k: int, tol: LogitTolerance
) -> ParityResult:
    """ref/tgt logits: [S, V] for tokens [S]; position p predicts tokens[p + 1]."""
    ref_lp = F.log_softmax(ref_logits.double(), dim=-1)
    tgt_lp = F.log_softmax(tgt_logits.double(), dim=-1)
    seq = ref_lp.shape[0]
    ref_top = ref_lp.topk(min(k, ref_lp.shape[-1]), dim=-1)
    tgt_top = tgt_lp.topk(min(k, tgt_lp.shape[-1]), dim=-1).indices
    margin = ref_top.values[:, 0] - ref_top.values[:, 1]
    ref_arg, tgt_arg = ref_top.indices[:, 0], tgt_top[:, 0]
    overlap = torch.tensor([len(set(a.tolist()) & set(b.tolist())) / a.numel() for a, b in zip(ref_top.indices, tgt_top, strict=True)])
    kl = (ref_lp.exp() * (ref_lp - tgt_lp)).sum(-1)
    nxt = torch.tensor(tokens[1:])
    lp_err = (ref_lp[:-1].gather(-1, nxt[:, None]) - tgt_lp[:-1].gather(-1, nxt[:, None])).abs().squeeze(-1)
    flips = []
    for p in (ref_arg != tgt_arg).nonzero().flatten().tolist():
        flips.append({"position": p, "ref_token": int(ref_arg[p]), "target_token": int(tgt_arg[p]),
                      "ref_margin": float(margin[p]), "near_tie": bool(margin[p] < tol.near_tie_margin)})
    first = None
    for f in flips:
        if f["position"] >= prompt_len - 1:
            first = {**f, "generated_index": f["position"] - (prompt_len - 1)}
            break
    reasons = []
    hard = [f for f in flips if not f["near_tie"]]
    if hard:
        reasons.append(f"top-1 differs at {len(hard)} position(s) with a clear reference margin (first: {hard[0]['position']})")
    bad_rows = (~torch.isfinite(tgt_logits)).any(-1)
    if bad_rows.any():
        reasons.append(f"target logits are not finite at {int(bad_rows.sum())} position(s) "
                       f"(first: {int(bad_rows.nonzero()[0])})")
    elif not kl.mean().item() <= tol.max_mean_kl:
        reasons.append(f"mean KL {kl.mean().item():.3g} > {tol.max_mean_kl:.3g}")
    return ParityResult(
        num_positions=seq,
        top1_agreement=(ref_arg == tgt_arg).double().mean().item(),
        topk_overlap=overlap.mean().item(),
        mean_kl=kl.mean().item(),
        max_kl=kl.max().item(),
        max_logprob_error=lp_err.max().item() if lp_err.numel() else 0.0,
        mean_logprob_error=lp_err.mean().item() if lp_err.numel() else 0.0,
        disagreements=flips[:20],
        first_divergence=first,
        ok=not reasons,
        reasons=reasons,
        nonfinite_positions=int(bad_rows.sum()),
    )


def ppl_token_count(num_available: int, window: int, stride: int, max_tokens: int) -> int:
    """Largest window + m * stride <= min(available, max_tokens): every window then has `window` tokens."""
    limit = min(num_available, max_tokens)
    if limit < window:
        return 0
    return window + (limit - window) // stride * stride
