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
from typing import Any, Literal

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
    # block formats: element bits plus the shared scale amortized over the block
    "bfp8": 8.5 / 8,  # Tenstorrent bfp8_b: 8 bits + an 8-bit exponent per 16 values
    "bfp4": 4.5 / 8,
    "bfp2": 2.5 / 8,
    "mxfp8": 8.25 / 8,  # OCP MX: 8 bits + an E8M0 scale per 32 values
    "mxint8": 8.25 / 8,
    "mxfp6": 6.25 / 8,
    "mxfp4": 4.25 / 8,
    "nvfp4": 4.5 / 8,  # 4 bits + an E4M3 scale per 16 values
}

# The compute_tflops entry that prices a block format's matmuls (B200 datasheet: FP6 runs at the FP8 rate).
COMPUTE_CLASS: dict[str, str] = {"bfp8": "fp8", "mxfp8": "fp8", "mxint8": "int8", "mxfp6": "fp8",
                                 "bfp4": "fp4", "bfp2": "fp4", "mxfp4": "fp4", "nvfp4": "fp4"}


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
    kernel_overhead_us: float = Field(default=4.0, ge=0)  # per kernel launch / fixed cost
    step_overhead_us: float = Field(default=0.0, ge=0)  # per engine step (scheduling, sampling, host)
    collective_overhead_us: float = Field(default=0.0, ge=0)  # software alpha per collective step


class MatmulNumericsSpec(_Strict):
    """How the chip's matrix unit computes one GEMM (format names: `firstlight.numerics.FORMATS`)."""

    a_format: str = "fp32"  # activations (first operand)
    b_format: str = "fp32"  # weights (second operand) of activation x weight matmuls
    a_scaling: str | None = None  # scalar fp8 operands: None (saturate) | "tensor" | "block:N"
    b_scaling: str | None = None
    b_blocks_along: Literal["k", "n"] = "k"  # weights' shared-scale blocks: along K (OCP MX) or N (TT tile rows)
    fidelity: str | None = None  # Tenstorrent math fidelity: lofi | hifi2 | hifi3 | hifi4; None = full multiplier
    accumulator: str = "fp32"  # format partial sums are held in
    promotion_interval: int | None = Field(default=None, ge=1)  # K between promotions of the partial sum to fp32
    rounding: Literal["rne", "stochastic", "truncate"] = "rne"  # of the narrow accumulator
    mma_k: int | None = Field(default=None, ge=1)  # K of one hardware MMA: the narrow sum is rounded after each


class HostFallbackSpec(_Strict):
    """The path an op that falls back to the host takes: its inputs and output cross this link."""

    bandwidth_gbps: float = Field(gt=0)
    latency_us: float = Field(ge=0)


class NumericsSpec(_Strict):
    """The chip's arithmetic, for the emulated targets (`--target emulate:<chip>`).

    Every tensor between ops is held in `activation`; activation x weight matmuls (aten.mm/addmm)
    compute as `matmul` says, activation x activation ones (aten.bmm: attention) as
    `attention_matmul`; ops in `transcendentals` use that approximation (`firstlight.numerics.APPROX`);
    an ATen compute op outside `lowered_ops` fails to compile unless an override decomposes it or
    sends it to the host. `fidelity_tflops` prices each fidelity when it sets the matmul rate.
    """

    activation: str = "fp32"
    matmul: MatmulNumericsSpec = MatmulNumericsSpec()
    attention_matmul: MatmulNumericsSpec | None = None  # None: `matmul` with both operands in a_format
    embedding: str | None = None  # format of the embedding table (None: `activation`)
    transcendentals: dict[str, str] = Field(default_factory=dict)  # op -> approximation name
    tile: tuple[int, int] | None = None  # matmul operands are padded to multiples of this (rows, cols)
    fidelity_tflops: dict[str, float] = Field(default_factory=dict)  # fidelity -> dense matmul TFLOP/s
    host_fallback: HostFallbackSpec | None = None
    lowered_ops: list[str]  # ATen op packets (e.g. "aten.mm") the chip's compiler lowers
    sources: dict[str, str]

    @model_validator(mode="after")
    def _check_sources(self) -> NumericsSpec:
        needed = ["activation", "matmul", "lowered_ops"]
        for name in ("attention_matmul", "embedding", "tile", "host_fallback"):
            if getattr(self, name) is not None:
                needed.append(name)
        needed += [n for n in ("transcendentals", "fidelity_tflops") if getattr(self, n)]
        missing = [k for k in needed if not self.sources.get(k, "").strip()]
        if missing:
            raise ValueError(f"numerics.sources has no entry for {missing}: cite a document or write 'estimate: why'")
        bad = [op for op in self.lowered_ops if not op.startswith("aten.")]
        if bad:
            raise ValueError(f"numerics.lowered_ops entries must be ATen op packets like 'aten.mm', got {bad}")
        return self


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
    numerics: NumericsSpec | None = None  # how it computes (emulated targets); None: not emulated
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
        dtype = COMPUTE_CLASS.get(dtype, dtype)
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


_ALIASES = {"mx": "b200", "h100": "h100-sxm", "a100": "a100-80gb", "mi300": "mi300x", "trn2": "trainium2", "v5e": "tpu-v5e",
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
