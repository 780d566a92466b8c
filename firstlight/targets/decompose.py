"""Scaled dot-product attention spelled out as matmul → mask → softmax → matmul.

The fused SDPA kernel hides its softmax and its mask inside one ATen op. Under `DecomposedSDPA`
every `F.scaled_dot_product_attention` call runs as separate ATen ops instead, so a fault in the
softmax or in the masking is visible op by op (used by the `faulty` target and by the harness's
op-level trace). Numerics follow the math backend: scores and softmax in fp32, then cast back.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


def sdpa_math(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """q: [B, H, S, D], k, v: [B, Hkv, L, D] → [B, H, S, D] (Vaswani et al. 2017, eq. 1)."""
    if dropout_p:
        raise ValueError("sdpa_math is for inference: dropout_p must be 0")
    if enable_gqa and k.shape[1] != q.shape[1]:
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(q, k.transpose(-2, -1)).float() * scale  # scores: [B, H, S, L]
    if is_causal:
        s, l_ = scores.shape[-2:]
        attn_mask = torch.ones(s, l_, dtype=torch.bool, device=q.device).tril(l_ - s)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(attn_mask.logical_not(), float("-inf"))
        else:
            scores = scores + attn_mask
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v)


class DecomposedSDPA(TorchFunctionMode):
    """Within this context, F.scaled_dot_product_attention runs as `sdpa_math`."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return sdpa_math(*args, **kwargs)
        return func(*args, **kwargs)
