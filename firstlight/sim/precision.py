"""Precision profiles: which number format each tensor group is stored and computed in.

Vendors rarely run one format end to end. tt-metal's performance config stores MLP weights in bfp4 and
attention weights in bfp8 with LoFi / HiFi2 math; TensorRT-LLM FP8 quantizes weights and GEMM inputs
to fp8 but keeps activations between kernels and all-reduces in bf16; w4a16 stores int4 weights and
multiplies in bf16. A profile names a dtype per tensor group (bytes moved) and, optionally, the math
dtype per op group (the `compute_tflops` key the GEMMs run at):

    attention_weights   q/k/v/o projections (MLA's down/up projections too)
    mlp_weights         dense MLP, shared experts
    expert_weights      routed experts (default: mlp_weights)
    lm_head             output projection (default: attention_weights)
    kv_cache            stored K/V (or MLA latents)
    activations         tensors between kernels, TP all-reduces, Q/O of attention
    math                {attention, mlp, lm_head, sdpa} -> dtype; default: `math.default`, else activations

Builtin profiles are YAML files in `sim/precisions/` (one per profile, each with its `source`);
`load_precision(name_or_path)` reads one. Unknown groups or dtypes are errors that name the key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from firstlight.core.hardware import DTYPE_BYTES
from firstlight.errors import FirstlightError

TENSOR_GROUPS = ("attention_weights", "mlp_weights", "expert_weights", "lm_head", "kv_cache", "activations")
MATH_GROUPS = ("default", "attention", "mlp", "lm_head", "sdpa")


class PrecisionError(FirstlightError):
    """A precision profile that names an unknown tensor group or dtype, or cannot be found."""


def _check_dtype(v: str | None) -> str | None:
    if v is not None and v not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {v!r}; known: {sorted(DTYPE_BYTES)}")
    return v


class PrecisionProfile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    source: str  # where this mix comes from (a vendor config, a paper) or "estimate: ..."
    description: str = ""
    attention_weights: str
    mlp_weights: str
    expert_weights: str | None = None
    lm_head: str | None = None
    kv_cache: str
    activations: str
    math: dict[str, str] = {}

    _dtypes = field_validator("attention_weights", "mlp_weights", "expert_weights", "lm_head", "kv_cache",
                              "activations")(_check_dtype)

    @field_validator("math")
    @classmethod
    def _check_math(cls, v: dict[str, str]) -> dict[str, str]:
        for k, d in v.items():
            if k not in MATH_GROUPS:
                raise ValueError(f"unknown math group {k!r}; expected one of {list(MATH_GROUPS)}")
            _check_dtype(d)
        return v

    @field_validator("source")
    @classmethod
    def _check_source(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("cite where the mix comes from, or write 'estimate: why'")
        return v

    # ---- resolved per group ---------------------------------------------------------------------
    def weights(self, group: str) -> str:
        """Storage dtype of a weight group: attention | mlp | experts | lm_head."""
        if group == "attention":
            return self.attention_weights
        if group == "mlp":
            return self.mlp_weights
        if group == "experts":
            return self.expert_weights or self.mlp_weights
        if group == "lm_head":
            return self.lm_head or self.attention_weights
        raise PrecisionError(f"unknown weight group {group!r}: expected attention, mlp, experts or lm_head")

    def math_dtype(self, group: str) -> str:
        """The `compute_tflops` key the ops of `group` (attention | mlp | lm_head | sdpa) run at."""
        return self.math.get(group) or self.math.get("default") or self.activations

    def with_dtypes(self, weight_dtype: str | None = None, kv_dtype: str | None = None) -> PrecisionProfile:
        """This profile with `--weight-dtype` / `--kv-dtype` overriding its storage groups: `weight_dtype`
        replaces every weight group (attention, mlp, experts, lm_head), `kv_dtype` the KV cache. Math rates
        and activations stay the profile's (a fp8 profile with bf16 weights still multiplies at fp8)."""
        if weight_dtype is None and kv_dtype is None:
            return self
        for opt, v in (("--weight-dtype", weight_dtype), ("--kv-dtype", kv_dtype)):
            if v is not None and v not in DTYPE_BYTES:
                raise PrecisionError(f"{opt} {v!r}: expected one of {sorted(DTYPE_BYTES)}")
        update: dict[str, Any] = {}
        tags = []
        if weight_dtype is not None:
            update |= {"attention_weights": weight_dtype, "mlp_weights": weight_dtype, "expert_weights": weight_dtype,
                       "lm_head": weight_dtype}
            tags.append(f"w{weight_dtype}")
        if kv_dtype is not None:
            update["kv_cache"] = kv_dtype
            tags.append(f"kv{kv_dtype}")
        update["name"] = f"{self.name}+{'+'.join(tags)}"
        return self.model_copy(update=update)

    def bytes_of(self, dtype: str) -> float:
        return DTYPE_BYTES[dtype]

    def describe(self) -> str:
        parts = [f"attn {self.attention_weights}", f"mlp {self.mlp_weights}"]
        if self.expert_weights:
            parts.append(f"experts {self.expert_weights}")
        parts += [f"kv {self.kv_cache}", f"act {self.activations}"]
        maths = {g: self.math_dtype(g) for g in ("attention", "mlp", "sdpa")}
        parts.append("math " + ("/".join(sorted(set(maths.values())))))
        return f"{self.name} ({', '.join(parts)})"

    def summary(self) -> dict[str, Any]:
        return {"name": self.name, "attention_weights": self.attention_weights, "mlp_weights": self.mlp_weights,
                "expert_weights": self.weights("experts"), "lm_head": self.weights("lm_head"),
                "kv_cache": self.kv_cache, "activations": self.activations,
                "math": {g: self.math_dtype(g) for g in MATH_GROUPS[1:]}, "source": self.source}


def uniform(weight_dtype: str, kv_dtype: str, act_dtype: str = "bf16") -> PrecisionProfile:
    """The profile a model loaded with one weight dtype implies: GEMMs at the weight dtype (the simulator's
    behaviour before profiles existed, kept so published validation rows do not move)."""
    name = weight_dtype if kv_dtype == weight_dtype else f"{weight_dtype}-kv{kv_dtype}"
    return PrecisionProfile(name=name, source="uniform: one dtype for every weight group",
                            attention_weights=weight_dtype, mlp_weights=weight_dtype, kv_cache=kv_dtype,
                            activations=act_dtype, math={"default": weight_dtype})


def builtin_precision_dir() -> Path:
    return Path(__file__).resolve().parent / "precisions"


def builtin_precisions() -> list[str]:
    return sorted(p.stem for p in builtin_precision_dir().glob("*.yaml"))


def _format(e: ValidationError, where: str) -> str:
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "<top level>"
        if err["type"] == "extra_forbidden":
            parts.append(f"unknown tensor group {loc!r}: expected one of {list(TENSOR_GROUPS)} (or name, source, "
                         "description, math)")
        elif err["type"] == "missing":
            parts.append(f"{loc}: field required")
        else:
            parts.append(f"{loc}: {err['msg'].removeprefix('Value error, ')}")
    return f"precision profile {where}: " + "; ".join(parts)


def precision_from_dict(data: Any, where: str = "<dict>") -> PrecisionProfile:
    if not isinstance(data, dict):
        raise PrecisionError(f"precision profile {where} must be a mapping, got {type(data).__name__}")
    try:
        return PrecisionProfile.model_validate(data)
    except ValidationError as e:
        raise PrecisionError(_format(e, where)) from None


def load_precision(name_or_path: str | Path) -> PrecisionProfile:
    """A builtin profile by name (`fp8`, `tt-performance`, ...) or a YAML file by path."""
    s = str(name_or_path)
    path = Path(s) if (s.endswith((".yaml", ".yml")) or Path(s).is_file()) else builtin_precision_dir() / f"{s}.yaml"
    if not path.is_file():
        raise PrecisionError(f"unknown precision profile {s!r}: expected one of {builtin_precisions()} or a YAML file")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise PrecisionError(f"precision profile {path} is not valid YAML: {e}") from None
    return precision_from_dict(data, str(path))
