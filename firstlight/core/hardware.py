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

import math
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from firstlight.errors import FirstlightError

# Block-scaled formats: `elem_bits` per element plus one `scale_bits` scale shared by `block` elements,
# so the amortized bytes per element are (elem_bits + scale_bits / block) / 8.
BLOCK_FORMATS: dict[str, dict[str, object]] = {
    # Tenstorrent block floats: 16 mantissas (sign + 7 or 3 bits) share one 8-bit exponent
    # (tt-metal tech_reports/data_formats: bfloat8_b / bfloat4_b, one exponent per 16-element row of a tile face)
    "bfp8": {"elem_bits": 8, "block": 16, "scale_bits": 8, "source": "tt-metal tech_reports/data_formats (bfloat8_b)"},
    "bfp4": {"elem_bits": 4, "block": 16, "scale_bits": 8, "source": "tt-metal tech_reports/data_formats (bfloat4_b)"},
    "bfp2": {"elem_bits": 2, "block": 16, "scale_bits": 8, "source": "tt-metal tech_reports/data_formats (bfloat2_b)"},
    # OCP Microscaling (MX) v1.0: 32 elements share one E8M0 scale
    "mxfp8": {"elem_bits": 8, "block": 32, "scale_bits": 8, "source": "OCP Microscaling Formats (MX) v1.0, sec. 5"},
    "mxfp6": {"elem_bits": 6, "block": 32, "scale_bits": 8, "source": "OCP Microscaling Formats (MX) v1.0, sec. 5"},
    "mxfp4": {"elem_bits": 4, "block": 32, "scale_bits": 8, "source": "OCP Microscaling Formats (MX) v1.0, sec. 5"},
    # NVIDIA NVFP4: E2M1 elements, one FP8 E4M3 scale per 16 (+ one fp32 per tensor, negligible)
    "nvfp4": {"elem_bits": 4, "block": 16, "scale_bits": 8, "source": "NVIDIA Blackwell NVFP4 (TensorRT Model Optimizer docs)"},
    "mxint8": {"elem_bits": 8, "block": 32, "scale_bits": 8, "source": "OCP Microscaling Formats (MX) v1.0, sec. 5"},
}

DTYPE_BYTES: dict[str, float] = {
    "fp64": 8,
    "fp32": 4,
    "tf32": 4,
    "bf16": 2,
    "fp16": 2,
    "fp8": 1,
    "int8": 1,
    "fp6": 0.75,
    "fp4": 0.5,
    "int4": 0.5,
    **{k: (int(v["elem_bits"]) + int(v["scale_bits"]) / int(v["block"])) / 8  # type: ignore[call-overload]
       for k, v in BLOCK_FORMATS.items()},
}

# flops_per_s falls back from a dtype the chip does not list to the next one here (narrow -> wide)
_RATE_ORDER = ["bfp2", "fp4", "nvfp4", "mxfp4", "int4", "bfp4", "fp6", "mxfp6", "fp8", "mxfp8", "bfp8", "int8", "mxint8",
               "bf16", "fp16", "tf32", "fp32", "fp64"]


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
    """Fractions of peak that kernels reach; one setting per spec, later calibrated from traces.

    `overlap` says how an op's compute and memory time combine: `max` (the roofline: a GPU streams
    operands while its tensor cores work) or `additive` (their sum: a CPU GEMM packs and streams the
    weights and then runs the FMAs, without overlapping the two). `gemv_memory` is the memory
    efficiency of a one-row product (a decode step of one sequence): a CPU BLAS runs it as a
    matrix-vector kernel that streams the weights once, faster than the packed GEMM it uses from two
    rows on; None = `memory`. See sim/cost.py and docs/VALIDATION.md (this machine's engine)."""

    compute: float = Field(default=0.7, gt=0, le=1)
    memory: float = Field(default=0.8, gt=0, le=1)
    network: float = Field(default=0.8, gt=0, le=1)
    attention: float = Field(default=1.0, gt=0, le=1)  # attention kernels reach this fraction of compute/memory
    kernel_overhead_us: float = Field(default=4.0, ge=0)  # per kernel launch / fixed cost
    step_overhead_us: float = Field(default=0.0, ge=0)  # per engine step (scheduling, launch, host)
    seq_overhead_us: float = Field(default=0.0, ge=0)  # per sequence per step (sampling, detokenize, output)
    request_overhead_us: float = Field(default=0.0, ge=0)  # per request once (API server, tokenize, admission)
    collective_overhead_us: float = Field(default=0.0, ge=0)  # software alpha per collective step
    overlap: Literal["max", "additive"] = "max"  # how an op's compute and memory time combine
    gemv_memory: float | None = Field(default=None, gt=0, le=1)  # memory efficiency of one-row products


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
    # Format the position tables (rotary cos/sin, models' `rotary` module) are computed in: fp32, as
    # every stack builds them (HF computes rotary angles in fp32; tt-metal on the host; JAX in fp32).
    tables: str = "fp32"
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


SYSTEM_PATTERNS = ("switch", "full_mesh", "ring", "line", "mesh2d", "torus2d", "torus3d")


class SystemLinkSpec(_Strict):
    """One class of links inside a box or rack: a `pattern` over groups of chips, or explicit `edges`.

    `bandwidth_gbps` is per link, per direction (for `switch`: each chip's link into the switch).
    Chips are numbered 0..num_chips-1; a pattern spans consecutive groups of `group_size` chips
    (default: all), laid out over `dims` for meshes and tori. Two classes joining the same pair add up.
    """

    name: str
    bandwidth_gbps: float = Field(gt=0)
    latency_us: float = Field(ge=0)
    pattern: str | None = None
    group_size: int | None = Field(default=None, ge=2)
    dims: list[int] | None = None
    edges: list[tuple[int, int]] | None = None
    links_per_edge: int = Field(default=1, ge=1)  # informational: physical links bundled into one edge

    @model_validator(mode="after")
    def _check_shape(self) -> SystemLinkSpec:
        if (self.pattern is None) == (self.edges is None):
            raise ValueError(f"link {self.name!r}: give exactly one of pattern ({'/'.join(SYSTEM_PATTERNS)}) or edges")
        if self.pattern is not None and self.pattern not in SYSTEM_PATTERNS:
            raise ValueError(f"link {self.name!r}: unknown pattern {self.pattern!r}; expected one of {list(SYSTEM_PATTERNS)}")
        if self.dims is not None and self.pattern not in ("mesh2d", "torus2d", "torus3d"):
            raise ValueError(f"link {self.name!r}: dims only apply to mesh2d/torus2d/torus3d")
        return self


class SystemSpec(_Strict):
    """A box or rack of chips: how many, how they are packaged, and the links between them."""

    name: str
    num_chips: int = Field(ge=1)
    chips_per_card: int = Field(default=1, ge=1)
    cards_per_node: int | None = Field(default=None, ge=1)
    links: list[SystemLinkSpec] = []

    @model_validator(mode="after")
    def _check_chips(self) -> SystemSpec:
        n = self.num_chips
        if n % self.chips_per_card:
            raise ValueError(f"num_chips={n} is not a multiple of chips_per_card={self.chips_per_card}")
        names = [lk.name for lk in self.links]
        if len(set(names)) != len(names):
            raise ValueError(f"system link names must be unique, got {names}")
        for i, lk in enumerate(self.links):
            where = f"links[{i}] ({lk.name!r})"
            if lk.edges is not None:
                for j, (a, b) in enumerate(lk.edges):
                    for c in (a, b):
                        if not 0 <= c < n:
                            raise ValueError(f"{where}.edges[{j}] = [{a}, {b}]: chip {c} does not exist "
                                             f"(this system has {n} chips, numbered 0..{n - 1})")
                    if a == b:
                        raise ValueError(f"{where}.edges[{j}] joins chip {a} to itself")
                continue
            g = lk.group_size or n
            if g > n or n % g:
                raise ValueError(f"{where}.group_size={g} must divide num_chips={n}")
            if lk.dims is not None:
                want = 3 if lk.pattern == "torus3d" else 2
                if len(lk.dims) != want or math.prod(lk.dims) != g:
                    raise ValueError(f"{where}.dims={lk.dims} must be {want} numbers whose product is the group "
                                     f"size {g}")
        self._check_connected()
        return self

    def _check_connected(self) -> None:
        parent = list(range(self.num_chips))

        def find(x: int) -> int:
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        for lk in self.links:
            if lk.edges is not None:
                pairs = [tuple(e) for e in lk.edges]
            else:
                g = lk.group_size or self.num_chips
                pairs = [(b, b + i) for b in range(0, self.num_chips, g) for i in range(1, g)]
            for a, b in pairs:
                parent[find(a)] = find(b)
        roots = {find(c) for c in range(self.num_chips)}
        if len(roots) > 1:
            alone = sorted(c for c in range(self.num_chips) if find(c) != find(0))
            raise ValueError(f"system {self.name!r}: chips {alone} have no path to chip 0; add a link class "
                             "(pattern or edges) that joins them")

    @property
    def num_cards(self) -> int:
        return self.num_chips // self.chips_per_card


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
    system: SystemSpec | None = None  # a box/rack of these chips; None = one chip (links says how it scales)
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
        missing = [p for p in self.figure_paths() if self.source_of(p) is None]
        if missing:
            raise ValueError(f"sources has no entry for {missing}: cite a datasheet or write 'estimate: why' "
                             "(a key covers every figure under it, e.g. 'memory' covers memory.bandwidth_gbps)")
        figures = self.figure_paths()
        for key in self.sources:
            if key.split(".")[0] in _SOURCED_GROUPS and not any(p == key or p.startswith(key + ".") for p in figures):
                raise ValueError(f"sources.{key} names no figure of this spec; figures are named like "
                                 f"{figures[0]!r} (see `firstlight sim specs --show NAME`)")
        return self

    def figure_paths(self) -> list[str]:
        """Every published or estimated number in the spec, as a dotted path (what `sources` must cover)."""
        paths = [f"compute_tflops.{d}" for d in self.compute_tflops]
        paths += ["memory.capacity_gib", "memory.bandwidth_gbps"]
        paths += [k for k in ("sram_mib", "power_w", "price_per_hour_usd") if getattr(self, k) is not None]
        for name in ("scale_up", "scale_out"):
            if getattr(self.links, name) is not None:
                paths += [f"links.{name}.bandwidth_gbps", f"links.{name}.latency_us"]
        paths += [f"efficiency.{k}" for k in EfficiencySpec.model_fields]
        if self.system is not None:
            for lk in self.system.links:
                paths += [f"system.links.{lk.name}.bandwidth_gbps", f"system.links.{lk.name}.latency_us"]
        return paths

    def source_of(self, path: str) -> str | None:
        """The most specific non-empty `sources` entry covering `path` (itself or a dotted prefix)."""
        parts = path.split(".")
        for i in range(len(parts), 0, -1):
            text = self.sources.get(".".join(parts[:i]), "").strip()
            if text:
                return text
        return None

    def figures(self) -> list[dict[str, Any]]:
        """[{path, value, source, estimate}] for every figure: what `firstlight sim specs --sources` prints."""
        data = self.model_dump()
        out = []
        for p in self.figure_paths():
            parts = p.split(".")
            if parts[0] == "system":
                lk = next(x for x in data["system"]["links"] if x["name"] == ".".join(parts[2:-1]))
                value = lk[parts[-1]]
            else:
                value = data
                for k in parts:
                    value = value[k]
            src = self.source_of(p) or ""
            out.append({"path": p, "value": value, "source": src, "estimate": is_estimate(src)})
        return out

    @property
    def num_chips(self) -> int:
        return self.system.num_chips if self.system else 1

    def flops_per_s(self, dtype: str) -> float:
        """Peak dense FLOP/s for `dtype`; falls back to the nearest wider dtype the chip lists."""
        order = _RATE_ORDER
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


_SOURCED_GROUPS = ("compute_tflops", "memory", "sram_mib", "power_w", "price_per_hour_usd", "links", "efficiency",
                   "system")


def is_estimate(source: str) -> bool:
    """A source text that flags its figure as an estimate (starts with 'estimate')."""
    return source.strip().lower().startswith("estimate")


def _format_validation_error(e: ValidationError, where: str) -> str:
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "<top level>"
        msg = err["msg"]
        if err["type"] == "missing":
            msg = "field required"
        parts.append(f"{loc}: {msg}")
    return f"hardware spec {where} is invalid: " + "; ".join(parts)


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _resolve_base(data: dict[str, Any], where: str, here: Path | None, seen: tuple[str, ...] = ()) -> dict[str, Any]:
    """`base: NAME_OR_PATH` starts from another spec's YAML and overrides it key by key (dicts merge).

    A system spec (`hgx-h100`, `t3k`) is its chip's spec plus a `system` section; the chip's figures and
    their sources come along, so each number is written (and cited) once.
    """
    if "base" not in data:
        return data
    ref = str(data["base"])
    if ref in seen:
        raise HardwareSpecError(f"hardware spec {where}: base chain {' -> '.join((*seen, ref))} loops")
    cand = Path(ref) if Path(ref).is_absolute() or here is None else here / ref
    if ref.endswith((".yaml", ".yml")) and cand.is_file():
        path = cand
    else:
        path = builtin_spec_dir() / f"{_ALIASES.get(ref.lower(), ref.lower())}.yaml"
        if not path.is_file():
            raise HardwareSpecError(f"hardware spec {where}: base {ref!r} is neither a builtin spec "
                                    f"({builtin_spec_names()}) nor a YAML file")
    parent = _read_yaml(path)
    parent = _resolve_base(parent, str(path), path.parent, (*seen, ref))
    child = {k: v for k, v in data.items() if k != "base"}
    merged = _deep_merge(parent, child)
    if "notes" not in child:
        merged.pop("notes", None)
    return merged


def spec_from_dict(data: dict[str, Any], where: str = "<dict>", here: Path | None = None) -> HardwareSpec:
    """Validate a dict as a HardwareSpec; errors name the file and the field."""
    if not isinstance(data, dict):
        raise HardwareSpecError(f"hardware spec {where} must be a YAML mapping, got {type(data).__name__}")
    data = _resolve_base(data, where, here)
    try:
        return HardwareSpec.model_validate(data)
    except ValidationError as e:
        raise HardwareSpecError(_format_validation_error(e, where)) from None


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise HardwareSpecError(f"hardware spec {path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise HardwareSpecError(f"hardware spec {path} must be a YAML mapping, got {type(data).__name__}")
    return data


def load_spec_file(path: str | Path) -> HardwareSpec:
    path = Path(path)
    if not path.is_file():
        raise HardwareSpecError(f"hardware spec file {path} does not exist")
    return spec_from_dict(_read_yaml(path), str(path), path.parent)


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
