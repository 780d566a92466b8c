"""The tables a model builds once per forward (rotary cos/sin, attention masks, scales), checked on their own.

A target builds these itself (the emulated chips compute cos/sin with their own transcendentals;
a compiler may fold a scale into a weight), and a wrong table breaks every layer at once. Compared
by themselves, a wrong table is blamed on the table, not on "how the target compiled the layer":
the harness feeds the layer units the *reference's* tables in isolation and the target's own in
propagation, so a layer that is right on the right table is not blamed for the wrong one.

Reference tables come from the HF model: its rotary embedding module's cos/sin (per layer type
for Gemma 3), HF's mask functions (`causal_mask_function`, `sliding_window_overlay`) evaluated on
absolute query and key positions plus "the key exists" (key position >= 0), and each attention's
`scaling`. Rows of padding queries (position -1) are don't-care and are not compared.

A reference without a rotary module (NoPE: Granite 4.0-H's attention takes no position embedding)
has no cos/sin to compare: its tables are the identity rotation (cos 1, sin 0), which the units get
in isolation and ignore, and `nope` marks them so the rope rows are left out (ours builds tables
that its NoPE attention does not read).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from firstlight.verify.metrics import compare
from firstlight.verify.tolerance import TolerancePolicy

SLIDING = "sliding_attention"


@dataclass
class Tables:
    """Per layer type: cos, sin [B, 1, S, D] and mask [B, 1, S, L] (bool)."""

    rope: dict[str, tuple[torch.Tensor, torch.Tensor]]
    masks: dict[str, torch.Tensor]
    nope: bool = False  # a reference without position embedding: identity cos/sin, not compared

    @classmethod
    def from_unit(cls, out: tuple[torch.Tensor, ...], types: list[str]) -> Tables:
        """From the `tables` unit's flat output (cos, sin, mask per sorted layer type)."""
        rope, masks = {}, {}
        for k, t in enumerate(sorted(types)):
            cos, sin, mask = out[3 * k: 3 * k + 3]
            rope[t], masks[t] = (cos, sin), mask
        return cls(rope, masks)

    def cast(self, dtype: torch.dtype) -> Tables:
        return Tables({t: (c.to(dtype), s.to(dtype)) for t, (c, s) in self.rope.items()}, dict(self.masks), self.nope)

    def _key(self, layer_type: str) -> str:
        """A hybrid model's recurrent layer types use no tables: they are handed the full-attention ones
        (as models/layers.py CausalLM._alias_state_layers does)."""
        return layer_type if layer_type in self.rope else "full_attention"

    def same_as(self, other: Tables, layer_type: str) -> bool:
        """Bit-identical tables for one layer type (then a unit's propagated output is its isolated one)."""
        a, b = self.rope[self._key(layer_type)], other.rope[other._key(layer_type)]
        return (all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b, strict=True))
                and torch.equal(self.masks[self._key(layer_type)], other.masks[other._key(layer_type)]))

    def inputs(self, layer_type: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (*self.rope[self._key(layer_type)], self.masks[self._key(layer_type)])


class ReferenceTables:
    """The HF reference's tables, for any positions: its rotary module and its mask functions."""

    def __init__(self, ref: nn.Module, layer_types: list[str]) -> None:
        self.ref = ref
        self.types = sorted(set(layer_types))
        hf_types = getattr(ref.config, "layer_types", None)
        window = getattr(ref.config, "sliding_window", None)
        # The window HF applies to the first of our layers of each type (HF decides by its own config).
        self.windows: dict[str, int | None] = {}
        for t in self.types:
            i = layer_types.index(t)
            hf_t = hf_types[i] if hf_types else (SLIDING if window else "full_attention")
            self.windows[t] = window if hf_t == SLIDING else None
        rot = getattr(ref.model, "rotary_emb", None)
        self.nope = rot is None  # NoPE (Granite 4.0-H): no rotary module, no tables to compare
        self._by_type = not self.nope and "layer_type" in inspect.signature(rot.forward).parameters
        cfg = ref.config
        self._head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    def rope(self, positions: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """fp32 cos, sin [B, 1, S, D] per layer type (HF's rotary embedding outputs)."""
        if self.nope:  # the identity rotation, [B, 1, S, D]
            ones = torch.ones(*positions.shape[:1], 1, positions.shape[-1], self._head_dim)
            return {t: (ones, torch.zeros_like(ones)) for t in self.types}
        rot = self.ref.model.rotary_emb
        x = torch.zeros(1, dtype=torch.float32)  # only its dtype and device are read
        out = {}
        with torch.no_grad():
            for t in self.types:
                cos, sin = rot(x, positions, t) if self._by_type else rot(x, positions)
                out[t] = (cos.float().unsqueeze(1), sin.float().unsqueeze(1))
        return out

    def mask(self, q_pos: torch.Tensor, k_pos: torch.Tensor, layer_type: str) -> torch.Tensor:
        """[B, 1, S, L] bool: HF's causal (and sliding window) mask function on absolute positions."""
        from transformers.masking_utils import causal_mask_function, sliding_window_overlay

        q, k = q_pos[:, :, None], k_pos[:, None, :]  # [B, S, 1], [B, 1, L]
        allowed = causal_mask_function(None, None, q, k) & (k >= 0)
        w = self.windows[layer_type]
        if w is not None:
            allowed = allowed & sliding_window_overlay(w)(None, None, q, k)
        return allowed.unsqueeze(1)

    def tables(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> Tables:
        return Tables(self.rope(q_pos), {t: self.mask(q_pos, k_pos, t) for t in self.types}, self.nope)


def _first_bad_rope_position(t: torch.Tensor, r: torch.Tensor, q_pos: torch.Tensor, tol: Any) -> int | None:
    """Smallest query position whose cos/sin row has an element beyond the element test."""
    t64, r64 = t.double().squeeze(1), r.double().squeeze(1)  # [B, S, D]
    rms = r64.pow(2).mean().sqrt()
    bad = ((t64 - r64).abs() > tol.atol_rms * rms + tol.rtol * r64.abs()) | ~torch.isfinite(t64)
    rows = bad.any(-1) & (q_pos >= 0)  # [B, S]
    return int(q_pos[rows].min()) if rows.any() else None


def compare_tables(target: Tables, reference: Tables, q_pos: torch.Tensor, k_pos: torch.Tensor,
                   dtype: torch.dtype, policy: TolerancePolicy, path: str) -> list[dict[str, Any]]:
    """One row per table: `tables.rope.<type>.cos|sin` (metrics, first bad position) and
    `tables.mask.<type>` (mismatching entries on real queries, the first one)."""
    rows: list[dict[str, Any]] = []
    real = q_pos >= 0  # [B, S]
    # layer types that build tables on both sides (a hybrid model's recurrent layers use none)
    for t in sorted(set(reference.rope) & set(target.rope)):
        for part, tt, rr in zip(("cos", "sin"), target.rope[t], reference.rope[t], strict=True):
            if reference.nope:  # no position embedding on the reference: nothing to compare
                break
            name = f"tables.rope.{t}.{part}"
            tol = policy.for_tensor(name)
            sel = real[:, None, :, None].expand_as(rr)
            m = compare(tt[sel], rr[sel], dtype, tol) if tt.shape == rr.shape else compare(tt, rr, dtype, tol)
            first = _first_bad_rope_position(tt, rr, q_pos, tol) if tt.shape == rr.shape else 0
            ok = m.ok and first is None
            rows.append({"name": name, "path": path, "ok": ok, "first_bad_position": first, **m.to_dict(),
                         "ok_metrics": m.ok})
        name = f"tables.mask.{t}"
        tm, rm = target.masks[t], reference.masks[t]
        row: dict[str, Any] = {"name": name, "path": path, "window": None}
        if tm.shape != rm.shape or tm.dtype != torch.bool:
            row.update(ok=False, note=f"target mask has shape {tuple(tm.shape)} {tm.dtype}; "
                                      f"expected {tuple(rm.shape)} bool", first_bad_position=None)
        else:
            diff = (tm != rm).squeeze(1) & real[:, :, None]  # [B, S, L]
            num = int(diff.sum())
            row.update(ok=num == 0, num_mismatched=num, frac_mismatched=num / max(1, int(real.sum()) * rm.shape[-1]),
                       first_bad_position=None)
            if num:
                b, s, j = (int(x) for x in diff.nonzero()[0])
                row.update(first_bad_position=int(q_pos[b, s]), first_bad={
                    "row": b, "query_position": int(q_pos[b, s]), "key_slot": j, "key_position": int(k_pos[b, j]),
                    "target": bool(tm[b, 0, s, j]), "reference": bool(rm[b, 0, s, j])})
        rows.append(row)
    return rows


def compare_scales(tmodel: nn.Module, ref: nn.Module) -> dict[str, Any]:
    """Each attention's softmax scale, ours (as the target prepared the model) against HF's `scaling`."""
    worst, first_bad = 0.0, None
    for i, layer in enumerate(tmodel.layers):
        # attention is `self_attn`, or a Nemotron-H block's `mixer`; a recurrent layer (HF Granite: None) or
        # an MLP block has no scale
        ref_attn = getattr(ref.model.layers[i], "self_attn", None) or getattr(ref.model.layers[i], "mixer", None)
        if not hasattr(ref_attn, "scaling"):
            continue
        ours_attn = getattr(layer, "self_attn", None) or getattr(layer, "mixer", None)
        ours = float(getattr(ours_attn, "scale", math.nan))
        theirs = float(ref_attn.scaling)
        err = abs(ours - theirs) / abs(theirs) if theirs else abs(ours - theirs)
        worst = max(worst, err) if math.isfinite(err) else math.inf
        if (not math.isfinite(err) or err > 1e-6) and first_bad is None:
            first_bad = {"layer": i, "target": ours, "reference": theirs}
    return {"name": "tables.scale.attention", "path": "model", "ok": first_bad is None,
            "max_rel_error": worst if math.isfinite(worst) else None, "first_bad": first_bad}
