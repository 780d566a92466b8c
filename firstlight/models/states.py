"""What one request keeps per recurrent layer (Gated DeltaNet, Mamba-2): the shapes the engine's state
slots and verify's serving paths allocate, by the layer's mixer type."""

from __future__ import annotations

import torch

from firstlight.models.config import LINEAR, MAMBA, STATE_TYPES
from firstlight.models.mamba2 import Mamba2Mixer


def state_shapes(model: torch.nn.Module, layer: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """The shape and dtype of each state one request keeps in a recurrent layer, by its mixer type:
    the conv inputs [C, K-1] (model dtype) and the recurrent state in fp32, as the mixer keeps it
    (Gated DeltaNet [Hv, Dk, Dv], Mamba-2 [H, P, N]). Attention layers keep none."""
    cfg = model.config
    dtype = next(model.parameters()).dtype
    layer_type = cfg.layer_types[layer]
    if layer_type == LINEAR:
        la = cfg.linear_attn
        return [((la.conv_dim, la.conv_kernel - 1), dtype),
                ((la.num_v_heads, la.k_head_dim, la.v_head_dim), torch.float32)]
    if layer_type == MAMBA:
        conv, ssm = Mamba2Mixer.state_shapes(cfg.mamba)
        return [(conv, dtype), (ssm, torch.float32)]
    if layer_type in STATE_TYPES:
        raise NotImplementedError(f"no state shapes for recurrent layer type {layer_type!r}")
    return []
