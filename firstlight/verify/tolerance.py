"""Tolerance policy: what counts as "matches" for a tensor or for logits, per target dtype.

A tensor passes when BOTH hold (numpy.allclose-style element test, with atol tied to the tensor's
own scale so one policy serves embeddings and logits alike):

    fraction of elements with |t - r| > atol_rms * rms(r) + rtol * |r|   <=  max_frac_beyond
    ||t - r||_2 / ||r||_2                                                <=  max_rel_l2

PCC and cosine are reported but never decide: both are blind to a uniform scale error (a tensor
multiplied by 2 has PCC 1), which is exactly the bug a wrong norm or a wrong constant produces.

Defaults come from the unit roundoff u of the dtype (fp32 2^-24, bf16 2^-8, fp16 2^-11): the
element test allows a few u times the error a dot product of a few thousand terms accumulates;
measured margins on SmolLM2-135M are in docs/VERIFY.md. Overrides apply per tensor name glob.
"""

from __future__ import annotations

import fnmatch
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from firstlight.errors import FirstlightError


@dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol_rms: float
    max_frac_beyond: float
    max_rel_l2: float


@dataclass(frozen=True)
class LogitTolerance:
    near_tie_margin: float  # ref logprob gap top1 - top2 below which a top-1 flip is a near-tie
    max_mean_kl: float  # nats, mean over positions of KL(ref || target)
    max_ppl_ratio: float  # target perplexity / reference perplexity


TENSOR_DEFAULTS: dict[torch.dtype, Tolerance] = {
    torch.float32: Tolerance(rtol=1e-3, atol_rms=1e-3, max_frac_beyond=1e-3, max_rel_l2=1e-3),
    torch.bfloat16: Tolerance(rtol=3e-2, atol_rms=3e-2, max_frac_beyond=2e-2, max_rel_l2=4e-2),
    torch.float16: Tolerance(rtol=8e-3, atol_rms=8e-3, max_frac_beyond=1e-2, max_rel_l2=1e-2),
}
LOGIT_DEFAULTS: dict[torch.dtype, LogitTolerance] = {
    torch.float32: LogitTolerance(near_tie_margin=1e-2, max_mean_kl=1e-4, max_ppl_ratio=1.001),
    torch.bfloat16: LogitTolerance(near_tie_margin=0.5, max_mean_kl=2e-2, max_ppl_ratio=1.03),
    torch.float16: LogitTolerance(near_tie_margin=0.2, max_mean_kl=5e-3, max_ppl_ratio=1.01),
}


@dataclass
class TolerancePolicy:
    dtype: torch.dtype
    tensor: Tolerance
    logits: LogitTolerance
    overrides: dict[str, Tolerance] = field(default_factory=dict)  # name glob -> tolerance

    @classmethod
    def for_dtype(cls, dtype: torch.dtype) -> TolerancePolicy:
        if dtype not in TENSOR_DEFAULTS:
            raise FirstlightError(f"no tolerance defaults for dtype {dtype}; use float32, bfloat16 or float16")
        return cls(dtype=dtype, tensor=TENSOR_DEFAULTS[dtype], logits=LOGIT_DEFAULTS[dtype])

    def for_tensor(self, name: str) -> Tolerance:
        """The tolerance of one tensor: the last override whose glob matches `name`, else the default."""
        tol = self.tensor
        for pattern, override in self.overrides.items():
            if fnmatch.fnmatchcase(name, pattern):
                tol = override
        return tol

    def with_file(self, path: str | Path) -> TolerancePolicy:
        """Apply a JSON file {"tensor": {...}, "logits": {...}, "overrides": {"glob": {...}}}."""
        p = Path(path)
        try:
            data = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise FirstlightError(f"tolerance file '{p}' cannot be read as JSON ({e})") from e
        try:
            tensor = replace(self.tensor, **data.get("tensor", {}))
            logits = replace(self.logits, **data.get("logits", {}))
            overrides = {**self.overrides, **{g: replace(tensor, **o) for g, o in data.get("overrides", {}).items()}}
        except TypeError as e:
            raise FirstlightError(
                f"tolerance file '{p}': {e}; tensor keys: rtol, atol_rms, max_frac_beyond, max_rel_l2; "
                "logits keys: near_tie_margin, max_mean_kl, max_ppl_ratio"
            ) from e
        return TolerancePolicy(self.dtype, tensor, logits, overrides)

    def to_dict(self) -> dict[str, Any]:
        return {"dtype": str(self.dtype).removeprefix("torch."), "tensor": asdict(self.tensor),
                "logits": asdict(self.logits), "overrides": {g: asdict(t) for g, t in self.overrides.items()}}
