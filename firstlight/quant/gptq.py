"""GPTQ (Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers", Algorithm 1), generic over the rounding grid of a format.

Round-to-nearest picks each weight's code alone. GPTQ quantizes the columns (input channels) of a
layer one at a time and spreads each column's rounding error over the columns not yet quantized so
that the layer's *output* on calibration inputs X moves least: it minimizes ||W X - Q X||^2 using
the Hessian H = 2 X X^T / n of that objective. With U the upper Cholesky factor of H^-1:

    for column j:   q_j = grid(w_j);   e_j = (w_j - q_j) / U[j, j];   W[:, j+1:] -= e_j U[j, j+1:]

done in blocks of `block_size` columns with a lazy update of the rest (the paper's step 3).
The grid is the format's own: int8 / fp8 per output channel (scale fixed from the whole row
before the sweep), int4 per group of G columns (scale and zero fitted when the sweep reaches the
group, on the already error-corrected weights, as in the reference implementation).

`act_order` (process columns by decreasing H[j, j], the reference code's "desc_act") is used for
per-channel grids only: with groups it would mix columns of different groups.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn


class Grid(Protocol):
    """How a format rounds weights. Parameters are tuples of [N] tensors (one value per row)."""

    group_size: int | None  # None: one set of parameters per row, fitted on the whole row

    def fit(self, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Parameters for w [N, C] (C = K per channel, or one group)."""
        ...

    def round(self, w: torch.Tensor, params: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """w [N, c] -> the nearest grid values [N, c] in fp32 under `params`."""
        ...


@dataclass
class GPTQResult:
    weight: torch.Tensor  # [N, K] fp32, every value on the grid
    params: tuple[torch.Tensor, ...]  # each [N] (per channel) or [N, K/G] (per group)


@torch.no_grad()
def collect_hessians(
    model: nn.Module, ids: Sequence[int], names: Iterable[str], seq_len: int = 512
) -> dict[str, torch.Tensor]:
    """H = X^T X / n (fp32 [K, K]) of the inputs of each named nn.Linear over the calibration ids.

    One forward pass over windows of `seq_len` tokens; memory is one K x K matrix per layer
    (~400 MB for SmolLM2-135M), independent of the number of calibration tokens.
    """
    modules = {n: model.get_submodule(n) for n in names}
    sums = {n: torch.zeros(m.in_features, m.in_features) for n, m in modules.items()}
    counts = dict.fromkeys(modules, 0)

    def hook(name: str):  # noqa: ANN202 - a forward pre-hook
        def pre(_mod: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            x = args[0].reshape(-1, args[0].shape[-1]).float()  # [M, K]
            sums[name].addmm_(x.t(), x)
            counts[name] += x.shape[0]
        return pre

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in modules.items()]
    try:
        tokens = torch.tensor([list(ids)])
        for begin in range(0, tokens.shape[1], seq_len):
            model(tokens[:, begin : begin + seq_len])
    finally:
        for h in handles:
            h.remove()
    return {n: sums[n] / max(counts[n], 1) for n in modules}


@torch.no_grad()
def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    grid: Grid,
    *,
    block_size: int = 128,
    damp: float = 0.01,
    act_order: bool = True,
) -> GPTQResult:
    """Quantize weight [N, K] onto `grid` with GPTQ under the Hessian [K, K] of its inputs."""
    w = weight.detach().float().clone()
    n, k = w.shape
    h = hessian.detach().float().clone()
    dead = torch.diag(h) == 0  # inputs that are always zero: their weights do not matter
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    group = grid.group_size
    params = grid.fit(w) if group is None else None
    perm = None
    if act_order and group is None:
        perm = torch.argsort(torch.diag(h), descending=True)
        w, h = w[:, perm], h[perm][:, perm]
    h += torch.eye(k) * (damp * torch.diag(h).mean())
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)  # U: H^-1 = U^T U

    q_all = torch.zeros_like(w)
    group_params: list[tuple[torch.Tensor, ...]] = []
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        w1, u1 = w[:, i1:i2].clone(), hinv[i1:i2, i1:i2]
        err1 = torch.zeros_like(w1)
        for i in range(i2 - i1):
            col = i1 + i
            if group is not None and col % group == 0:
                # fit this group's scale/zero on the error-corrected weights (later columns of the
                # group are still unquantized: take them from w1 or, past this block, from w)
                span = torch.cat([w1[:, i:], w[:, i2:]], dim=1)[:, :group]
                params = grid.fit(span)
                group_params.append(params)
            q = grid.round(w1[:, i : i + 1], params)  # [N, 1]
            q_all[:, col : col + 1] = q
            e = (w1[:, i : i + 1] - q) / u1[i, i]  # [N, 1]
            w1[:, i:] -= e @ u1[i : i + 1, i:]
            err1[:, i : i + 1] = e
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]

    if perm is not None:
        q_all = q_all[:, torch.argsort(perm)]
    if group is not None:
        params = tuple(torch.stack([p[j] for p in group_params], dim=1) for j in range(len(group_params[0])))
    assert params is not None
    return GPTQResult(q_all, params)


def output_error(weight: torch.Tensor, approx: torch.Tensor, hessian: torch.Tensor) -> float:
    """tr(D H D^T) with D = approx - weight: the mean squared output error on the calibration inputs."""
    d = (approx.float() - weight.float())
    return float(torch.einsum("nk,kl,nl->", d, hessian.float(), d))
