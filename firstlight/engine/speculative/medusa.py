"""Medusa heads (Cai et al. 2024): K small residual blocks on the target's last hidden state; head i
predicts the token i+2 positions ahead through the target's own (frozen) LM head.

    h: [E] final-normed hidden at position t (the target predicts token t+1 from it)
    head_i(h) = h + SiLU(W_i h + b_i)          logits_i = target.compute_logits(head_i(h))  → token t+2+i

W_i starts at zero, so an untrained head repeats the target's next-token guess. The file format is
safetensors with metadata naming the model and the hash of its config, so heads trained for one
model refuse to load for another.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from firstlight.errors import FirstlightError

HEADS_FILE = "firstlight_heads.safetensors"
FORMAT = "firstlight-medusa-v1"


def config_hash(model_config: Any) -> str:
    """sha256 (first 16 hex) of the model's HF config dict: what the heads were trained against."""
    hf = getattr(model_config, "hf", None) or {}
    return hashlib.sha256(json.dumps(hf, sort_keys=True, default=str).encode()).hexdigest()[:16]


def model_name(model_config: Any) -> str:
    hf = getattr(model_config, "hf", None) or {}
    if hf.get("_name_or_path"):
        return str(hf["_name_or_path"])
    return f"{hf.get('model_type', 'model')}-{hf.get('num_hidden_layers', '?')}L-{hf.get('hidden_size', '?')}d"


class MedusaHeads(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        self.hidden_size, self.num_heads = hidden_size, num_heads
        self.proj = nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(num_heads))
        for p in self.proj:
            nn.init.zeros_(p.weight)
            nn.init.zeros_(p.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [..., E] → [..., K, E] (feed to the target's compute_logits)."""
        return torch.stack([hidden + nn.functional.silu(p(hidden)) for p in self.proj], dim=-2)


def default_heads_path(model_dir: str | Path) -> Path:
    return Path(model_dir) / HEADS_FILE


def save_heads(heads: MedusaHeads, path: str | Path, model_config: Any, model_label: str, extra: dict[str, str] | None = None) -> Path:
    from safetensors.torch import save_file

    meta = {
        "format": FORMAT,
        "model": model_label,
        "config_hash": config_hash(model_config),
        "num_heads": str(heads.num_heads),
        "hidden_size": str(heads.hidden_size),
        **(extra or {}),
    }
    path = Path(path)
    tmp = path.with_suffix(".tmp")
    save_file({k: v.detach().contiguous().cpu() for k, v in heads.state_dict().items()}, str(tmp), metadata=meta)
    tmp.replace(path)
    return path


def load_heads(path: str | Path, model_config: Any, model_label: str) -> tuple[MedusaHeads, dict[str, str]]:
    """Heads from a file, checked against the model they will run on (named mismatch error)."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise FirstlightError(
            f"heads file {path} not found; train heads with `firstlight train heads --model <model>` "
            "or pass --heads <file>"
        )
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            state = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
    except Exception as e:  # noqa: BLE001 - safetensors raises several types for a bad file
        raise FirstlightError(f"heads file {path} is not a readable safetensors file ({e})") from e
    if meta.get("format") != FORMAT:
        raise FirstlightError(f"heads file {path} is not a firstlight heads file (format {meta.get('format')!r}, expected {FORMAT})")
    want = config_hash(model_config)
    if meta.get("config_hash") != want:
        raise FirstlightError(
            f"heads file {path} was trained for model '{meta.get('model')}' (config {meta.get('config_hash')}) "
            f"but the target is '{model_label}' (config {want}); train heads for this model with "
            "`firstlight train heads`"
        )
    heads = MedusaHeads(int(meta["hidden_size"]), int(meta["num_heads"]))
    heads.load_state_dict(state)
    return heads, meta
