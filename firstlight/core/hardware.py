"""HardwareSpec: a chip described by the figures that bound its speed, each with a source.

A spec is a YAML file validated by pydantic. The simulator (`firstlight.sim`) prices ops with it;
the emulated-chip targets read the same files. Units are explicit in every field name:

    compute_tflops     dense (no sparsity) TFLOP/s per dtype, 1e12 FLOP/s
    memory.capacity_gib  device memory in GiB (2**30 bytes)
    *_gbps             GB/s = 1e9 bytes/s, **per direction**
    latency_us         one-way latency of one hop, microseconds

Every figure group must have an entry in `sources` (a datasheet, paper or "estimate: ..."), so a
reader can always tell a published number from a guess. Unknown keys are an error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from firstlight.errors import FirstlightError

DTYPE_BYTES: dict[str, float] = {
    "fp64": 8,
    "fp32": 4,
    "tf32": 4,
    "bf16": 2,
    "fp16": 2,
    "fp8": 1,
    "int8": 1,
    "fp4": 0.5,
    "int4": 0.5,
}


class HardwareSpecError(FirstlightError):
    """A hardware spec file or name that cannot be used."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class MemorySpec(_Strict):
    capacity_gib: float = Field(gt=0)
    bandwidth_gbps: float = Field(gt=0)
    kind: str = ""  # HBM3, GDDR6, DDR5 ...

    @property
    def capacity_bytes(self) -> float:
        return self.capacity_gib * 2**30

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return self.bandwidth_gbps * 1e9


class LinkSpec(_Strict):
    """One class of interconnect as seen from one device."""

    bandwidth_gbps: float = Field(gt=0)  # per direction, per device (all ports of this class together)
    latency_us: float = Field(ge=0)
    ports: int = Field(default=1, ge=1)
    topology: str = "switch"  # how devices of one domain connect: switch, full_mesh, ring, torus2d, ...
    domain_size: int = Field(default=1, ge=1)  # devices reachable over this link class without leaving it
    name: str = ""

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return self.bandwidth_gbps * 1e9

    @property
    def latency_s(self) -> float:
        return self.latency_us * 1e-6


class LinksSpec(_Strict):
    scale_up: LinkSpec | None = None  # NVLink, Infinity Fabric, ICI, NeuronLink, Ethernet mesh
    scale_out: LinkSpec | None = None  # InfiniBand / RoCE / EFA / DCN NIC per device


class EfficiencySpec(_Strict):
    """Fractions of peak that kernels reach; one setting per spec, later calibrated from traces."""

    compute: float = Field(default=0.7, gt=0, le=1)
    memory: float = Field(default=0.8, gt=0, le=1)
    network: float = Field(default=0.8, gt=0, le=1)
    attention: float = Field(default=1.0, gt=0, le=1)  # attention kernels reach this fraction of compute/memory
    kernel_overhead_us: float = Field(default=4.0, ge=0)  # per kernel launch / fixed cost
    step_overhead_us: float = Field(default=0.0, ge=0)  # per engine step (scheduling, launch, host)
    seq_overhead_us: float = Field(default=0.0, ge=0)  # per sequence per step (sampling, detokenize, output)
    request_overhead_us: float = Field(default=0.0, ge=0)  # per request once (API server, tokenize, admission)
    collective_overhead_us: float = Field(default=0.0, ge=0)  # software alpha per collective step


class HardwareSpec(_Strict):
    name: str
    vendor: str = ""
    kind: str = "accelerator"  # accelerator | cpu
    compute_tflops: dict[str, float]
    memory: MemorySpec
    sram_mib: float | None = Field(default=None, ge=0)  # on-chip SRAM / last-level cache
    links: LinksSpec = LinksSpec()
    power_w: float | None = Field(default=None, gt=0)
    price_per_hour_usd: float | None = Field(default=None, ge=0)
    efficiency: EfficiencySpec = EfficiencySpec()
    sources: dict[str, str]
    notes: str = ""

    @field_validator("compute_tflops")
    @classmethod
    def _check_compute(cls, v: dict[str, float]) -> dict[str, float]:
        if not v:
            raise ValueError("needs at least one dtype, e.g. {bf16: 989}")
        for dtype, rate in v.items():
            if dtype not in DTYPE_BYTES:
                raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(DTYPE_BYTES)}")
            if not rate > 0:
                raise ValueError(f"compute_tflops.{dtype} must be > 0, got {rate}")
        return v

    @model_validator(mode="after")
    def _check_sources(self) -> HardwareSpec:
        needed = ["compute_tflops", "memory"]
        for name in ("sram_mib", "power_w", "price_per_hour_usd"):
            if getattr(self, name) is not None:
                needed.append(name)
        for name in ("scale_up", "scale_out"):
            if getattr(self.links, name) is not None:
                needed.append(f"links.{name}")
        missing = [k for k in needed if not self.sources.get(k, "").strip()]
        if missing:
            raise ValueError(f"sources has no entry for {missing}: cite a datasheet or write 'estimate: why'")
        return self

    def flops_per_s(self, dtype: str) -> float:
        """Peak dense FLOP/s for `dtype`; falls back to the nearest wider dtype the chip lists."""
        order = ["fp4", "int4", "fp8", "int8", "bf16", "fp16", "tf32", "fp32", "fp64"]
        if dtype in self.compute_tflops:
            return self.compute_tflops[dtype] * 1e12
        start = order.index(dtype) if dtype in order else 0
        for d in order[start:]:
            if d in self.compute_tflops:
                return self.compute_tflops[d] * 1e12
        raise HardwareSpecError(
            f"hardware spec {self.name!r} lists no compute rate for {dtype!r} or any wider dtype "
            f"(has {sorted(self.compute_tflops)}); add compute_tflops.{dtype} to the spec"
        )


def _format_validation_error(e: ValidationError, where: str) -> str:
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "<top level>"
        msg = err["msg"]
        if err["type"] == "missing":
            msg = "field required"
        parts.append(f"{loc}: {msg}")
    return f"hardware spec {where} is invalid: " + "; ".join(parts)


def spec_from_dict(data: dict[str, Any], where: str = "<dict>") -> HardwareSpec:
    """Validate a dict as a HardwareSpec; errors name the file and the field."""
    if not isinstance(data, dict):
        raise HardwareSpecError(f"hardware spec {where} must be a YAML mapping, got {type(data).__name__}")
    try:
        return HardwareSpec.model_validate(data)
    except ValidationError as e:
        raise HardwareSpecError(_format_validation_error(e, where)) from None


def load_spec_file(path: str | Path) -> HardwareSpec:
    path = Path(path)
    if not path.is_file():
        raise HardwareSpecError(f"hardware spec file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise HardwareSpecError(f"hardware spec {path} is not valid YAML: {e}") from None
    return spec_from_dict(data, str(path))


def builtin_spec_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "sim" / "specs"


def builtin_spec_names() -> list[str]:
    return sorted(p.stem for p in builtin_spec_dir().glob("*.yaml"))


_ALIASES = {"h100": "h100-sxm", "a100": "a100-80gb", "mi300": "mi300x", "trn2": "trainium2", "v5e": "tpu-v5e",
            "n300": "wormhole-n300", "p150": "blackhole-p150", "cpu": "cpu-host"}


def load_spec(name_or_path: str | Path) -> HardwareSpec:
    """A builtin spec by name (`h100`, `mi300x`, ...) or a user YAML file by path."""
    s = str(name_or_path)
    if s.endswith((".yaml", ".yml")) or Path(s).is_file():
        return load_spec_file(s)
    key = _ALIASES.get(s.lower(), s.lower())
    path = builtin_spec_dir() / f"{key}.yaml"
    if not path.is_file():
        raise HardwareSpecError(
            f"unknown hardware {s!r}: expected one of {builtin_spec_names()} or a path to a spec YAML file"
        )
    return load_spec_file(path)
