"""Matmuls the way an accelerator computes them: operand formats, a mantissa-limited multiplier
(Tenstorrent math fidelity), a narrow accumulator with periodic promotion to fp32 (Hopper FP8
GEMMs), stochastic rounding with a seed, and tile padding. Vectorized torch: one fp32 matmul per
fidelity product in the common case; a loop over K chunks only when a narrow accumulator is emulated.

Math fidelity (Tenstorrent Wormhole / Blackhole). The matrix unit's multipliers take 7 bits of the
SrcB operand's significand and 5 of SrcA's (hidden bit included); `MVMUL` computes
Dst += SrcB @ SrcA, and a matmul unpacks in0 (activations, `a` here) to SrcB and in1 (weights, `b`)
to SrcA (tt-metal llk_api/llk_unpack_AB_matmul_api.h: "In0 -> srcB, In1 -> srcA"). A fidelity
phase p multiplies one slice of each (tt-isa-documentation, WormholeB0 ELWMUL/MVMUL functional
model, `SrcAFidelityBits` / `SrcBFidelityBits`):

    SrcA (b): p & 1 == 0 -> sign, exponent, hidden bit + mantissa bits 22..19   (mask 0xFFF80000)
              p & 1 == 1 -> mantissa bits 18..14 (the next five; bit 13, TF32's last, is ignored)
    SrcB (a): p & 2 == 0 -> hidden bit + mantissa bits 22..17                   (mask 0xFFFE0000)
              p & 2 == 2 -> mantissa bits 16..13 (the next four)

LoFi runs phase 0, HiFi2 phases 0-1, HiFi3 phases 0-2, HiFi4 phases 0-3, each adding its products
into Dst (tt-metal tech_reports/matrix_engine/matrix_engine.md: "MATH_FIDELITY ... number of times
an operation is run"; its prose gives 4/6 bits for the low slices, the ISA functional model's masks
give 5/4, which fit the 10-bit TF32 mantissa; we follow the masks). Summed, the phases are
LoFi = a_hi @ b_hi, HiFi2 = a_hi @ b, HiFi3 = a_hi @ b + a_lo @ b_hi, HiFi4 = a @ b (on the bits the
registers hold); with an fp32 accumulator that is what we compute, 1-2 matmuls. With a narrow
accumulator every phase's product is added and rounded separately, as Dst is.

Accumulation. `accumulator` is the format partial sums live in. With a narrow one, K is cut into
chunks of `mma_k` (one hardware MMA: 16 for Tenstorrent MVMUL, 32 for a Hopper FP8 WGMMA); each
chunk's products are summed in fp32 (the MMA's internal adder tree) and added into the narrow
accumulator, which is rounded to its format (`rounding`); every `promotion_interval` values of K the
narrow sum is added into an fp32 accumulator and cleared (DeepSeek-V3 tech report, sec. 3.3.2:
promotion every 4 WGMMAs, K = 128). `promotion_interval=None` keeps the whole K in the narrow format
(a Tenstorrent matmul with `fp32_dest_acc_en=False` accumulates in a bf16 Dst).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from firstlight.numerics.errors import NumericsError
from firstlight.numerics.formats import SCALAR_KINDS, get_format, quantize
from firstlight.numerics.scalar import ROUNDINGS, Noise, round_e8_

FIDELITIES = ("lofi", "hifi2", "hifi3", "hifi4")
NUM_PHASES = {"lofi": 1, "hifi2": 2, "hifi3": 3, "hifi4": 4}
# int32 views of the ISA masks (0xFFF80000 etc. as signed 32-bit)
SRCA_HI_MASK = 0xFFF80000 - 2**32  # b: sign, exponent, 1 + 4 mantissa bits
SRCA_ALL_MASK = 0xFFFFC000 - 2**32  # b: 9 mantissa bits (TF32's last bit ignored)
SRCB_HI_MASK = 0xFFFE0000 - 2**32  # a: sign, exponent, 1 + 6 mantissa bits
SRCB_ALL_MASK = 0xFFFFE000 - 2**32  # a: 10 mantissa bits
DEFAULT_MMA_K = 32  # one 32x32 tile of K when neither mma_k nor promotion_interval says otherwise
# chunk partial products held at once: 2 MiB of fp32, so a group of partials and the running sum stay in
# the CPU's cache while they are summed (measured on the 2-core EPYC: 3-4x faster than 128 MiB groups)
MAX_PARTIAL_ELEMENTS = 1 << 19


@dataclass(frozen=True)
class MatmulNumerics:
    """How one chip computes `a @ b`. Defaults are a plain fp32 matmul."""

    a_format: str = "fp32"  # activations (in0)
    b_format: str = "fp32"  # weights (in1)
    fidelity: str | None = None  # None: full-precision multiplier
    accumulator: str = "fp32"  # format partial sums are held in
    promotion_interval: int | None = None  # K values between promotions of the narrow sum into fp32
    rounding: str = "rne"  # of the accumulator: "rne" | "stochastic" | "truncate"
    seed: int | None = None  # stochastic rounding: same seed, same bits
    tile: tuple[int, int] | None = None  # pad M / N / K to tile multiples (32x32 on Tenstorrent)
    mma_k: int | None = None  # K depth per narrow-accumulator rounding (16: TT MVMUL; 32: Hopper WGMMA)

    def __post_init__(self) -> None:
        for field_name in ("a_format", "b_format", "accumulator"):
            get_format(getattr(self, field_name))
        if get_format(self.accumulator).kind not in SCALAR_KINDS or get_format(self.accumulator).kind == "int":
            raise NumericsError(f"accumulator {self.accumulator!r} must be a scalar float format (fp32, fp22, bf16, ...)")
        if self.fidelity is not None and self.fidelity not in FIDELITIES:
            raise NumericsError(f"unknown math fidelity {self.fidelity!r}: expected one of {', '.join(FIDELITIES)} or None")
        if self.rounding not in ROUNDINGS:
            raise NumericsError(f"unknown accumulator rounding {self.rounding!r}: expected one of {', '.join(ROUNDINGS)}")
        if self.rounding == "stochastic" and self.seed is None:
            raise NumericsError("accumulator rounding 'stochastic' needs a seed (MatmulNumerics(seed=...))")
        for field_name in ("promotion_interval", "mma_k"):
            value = getattr(self, field_name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise NumericsError(f"{field_name} must be a positive integer or None, got {value!r}")
        if self.promotion_interval and self.mma_k and self.promotion_interval % self.mma_k:
            raise NumericsError(
                f"promotion_interval {self.promotion_interval} must be a multiple of mma_k {self.mma_k}"
            )
        if self.tile is not None and (len(self.tile) != 2 or min(self.tile) <= 0):
            raise NumericsError(f"tile must be two positive sizes (rows, cols), got {self.tile!r}")

    @property
    def narrow_accumulator(self) -> bool:
        return get_format(self.accumulator).name != "fp32"

    @property
    def chunk_k(self) -> int:
        return self.mma_k or self.promotion_interval or DEFAULT_MMA_K


def _mask(x: torch.Tensor, mask: int) -> torch.Tensor:
    return (x.to(torch.float32).contiguous().view(torch.int32) & mask).view(torch.float32)


def _split(x: torch.Tensor, hi_mask: int, all_mask: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _mask(x, hi_mask), _mask(x, all_mask)


def _pairs(
    a: torch.Tensor, b_parts: tuple[torch.Tensor, ...], fidelity: str | None, merged: bool
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """b_parts: (b,) without fidelity, (b_hi, b_all) with it."""
    if fidelity is None:
        return [(a, b_parts[0])]
    a_hi, a_all = _split(a, SRCB_HI_MASK, SRCB_ALL_MASK)
    b_hi, b_all = b_parts
    if merged:
        return {
            "lofi": [(a_hi, b_hi)],
            "hifi2": [(a_hi, b_all)],
            "hifi3": [(a_hi, b_all), (a_all - a_hi, b_hi)],
            "hifi4": [(a_all, b_all)],
        }[fidelity]
    a_lo, b_lo = a_all - a_hi, b_all - b_hi
    phases = [(a_hi, b_hi), (a_hi, b_lo), (a_lo, b_hi), (a_lo, b_lo)]
    return phases[: NUM_PHASES[fidelity]]


def fidelity_products(
    a: torch.Tensor, b: torch.Tensor, fidelity: str | None, *, merged: bool = True
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (a_part, b_part) pairs whose matmuls sum to the product the fidelity computes.

    merged=True combines phases that share an operand slice (fewest matmuls, for an fp32
    accumulator); merged=False gives one pair per hardware phase (0..N-1), in phase order.
    """
    b_parts = (b,) if fidelity is None else _split(b, SRCA_HI_MASK, SRCA_ALL_MASK)
    return _pairs(a, b_parts, fidelity, merged)


@dataclass(frozen=True)
class PreparedWeight:
    """A weight quantized to `numerics.b_format`, tile-padded and split into its fidelity slices once,
    as a target keeps a compiled kernel's weights: pass it to `matmul` as `b`."""

    parts: tuple[torch.Tensor, ...]  # (b,) or (b_hi, b_all): [..., K', N'] after tile padding
    shape: tuple[int, ...]  # the original [..., K, N]
    numerics: MatmulNumerics
    axis: int


def prepare_weight(b: torch.Tensor, numerics: MatmulNumerics, *, b_axis: int = -2) -> PreparedWeight:
    """b [..., K, N] quantized to numerics.b_format (blocks along b_axis), tile-padded, fidelity-split."""
    if b.dim() < 2:
        raise NumericsError(f"a weight must be [..., K, N], got shape {tuple(b.shape)}")
    shape = tuple(b.shape)
    b = b.to(torch.float32)
    if numerics.tile is not None:
        rows, cols = numerics.tile
        b = _pad_to(_pad_to(b, -2, math.lcm(rows, cols)), -1, cols)
    b = quantize(b, numerics.b_format, axis=b_axis)
    parts = (b,) if numerics.fidelity is None else _split(b, SRCA_HI_MASK, SRCA_ALL_MASK)
    return PreparedWeight(parts, shape, numerics, b_axis)


def _pad_to(x: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    extra = (-x.shape[dim]) % multiple
    if not extra:
        return x
    pad = [0, 0] * (x.dim() - dim % x.dim() - 1) + [0, extra]
    return F.pad(x, pad)


def _narrow_accumulate(
    pairs: list[tuple[torch.Tensor, torch.Tensor]], numerics: MatmulNumerics, generator: torch.Generator | None
) -> torch.Tensor:
    """Sum over K with the partial sum rounded to the accumulator format after every chunk and phase."""
    g = numerics.chunk_k
    pairs = [(_pad_to(a, -1, g), _pad_to(b, -2, g)) for a, b in pairs]
    num_chunks = pairs[0][0].shape[-1] // g
    chunks_per_promotion = (numerics.promotion_interval // g) if numerics.promotion_interval else None
    if chunks_per_promotion == 0:
        raise NumericsError(f"promotion_interval {numerics.promotion_interval} is shorter than mma_k {g}")
    # [..., M, nC, g] -> [..., nC, M, g]  and  [..., nC*g, N] -> [..., nC, g, N]
    split = [(a.unflatten(-1, (num_chunks, g)).movedim(-2, -3), b.unflatten(-2, (num_chunks, g))) for a, b in pairs]
    a0, b0 = pairs[0]
    out_shape = torch.broadcast_shapes(a0.shape[:-2], b0.shape[:-2]) + (a0.shape[-2], b0.shape[-1])
    per_chunk = max(1, math.prod(out_shape))
    group = max(1, MAX_PARTIAL_ELEMENTS // per_chunk)
    fmt = get_format(numerics.accumulator)
    in_place = fmt.exp_bits == 8  # bf16 / tf32 / fp22: round the running sum in place
    cast_to = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(fmt.name) if numerics.rounding == "rne" else None
    dev = pairs[0][0].device
    total = torch.zeros(out_shape, dtype=torch.float32, device=dev)
    # the running narrow sum; with torch's own cast it is held in that dtype and every step writes into
    # preallocated buffers (no allocation, so no page faults, per chunk)
    acc = torch.zeros(out_shape, dtype=cast_to or torch.float32, device=dev)
    tmp = torch.empty(out_shape, dtype=torch.float32, device=dev) if cast_to is not None else None
    for start in range(0, num_chunks, group):
        stop = min(num_chunks, start + group)
        partials = [a[..., start:stop, :, :] @ b[..., start:stop, :, :] for a, b in split]  # [..., c, M, N]
        for c in range(stop - start):
            for p in partials:
                if tmp is not None:  # torch's own casts round to nearest even, like ours, faster
                    torch.add(p[..., c, :, :], acc, out=tmp)
                    acc.copy_(tmp)
                elif in_place:
                    acc.add_(p[..., c, :, :])
                    noise = Noise.draw(generator) if generator is not None else None
                    round_e8_(acc, fmt.man_bits, numerics.rounding, noise)
                else:
                    acc = quantize(acc + p[..., c, :, :], fmt, rounding=numerics.rounding, generator=generator)
            if chunks_per_promotion and ((start + c + 1) % chunks_per_promotion == 0):
                total.add_(acc)
                acc.zero_()
    return (total + acc) if chunks_per_promotion else acc.to(torch.float32)


def matmul(
    a: torch.Tensor,
    b: torch.Tensor | PreparedWeight,
    numerics: MatmulNumerics,
    *,
    a_axis: int = -1,
    b_axis: int = -2,
) -> torch.Tensor:
    """a [..., M, K] @ b [..., K, N] -> float32 [..., M, N], computed as `numerics` says.

    Operands are quantized to their formats with blocks along `a_axis` / `b_axis` (K by default;
    weights stored [K, N] in Tenstorrent tiles have their bfp blocks along N: b_axis=-1). A weight
    used many times can be prepared once with `prepare_weight(b, numerics)` (quantized, padded,
    fidelity-split), which saves its per-call cost.
    """
    if isinstance(b, PreparedWeight):
        if (b.numerics.b_format, b.numerics.fidelity, b.numerics.tile) != (
            numerics.b_format, numerics.fidelity, numerics.tile,
        ):  # fmt: skip
            raise NumericsError(
                f"weight prepared for b_format={b.numerics.b_format}, fidelity={b.numerics.fidelity}, "
                f"tile={b.numerics.tile}; this matmul wants {numerics.b_format}, {numerics.fidelity}, {numerics.tile}"
            )
        b_shape, prepared = b.shape, b
    else:
        b_shape, prepared = tuple(b.shape), None
    if a.dim() < 2 or len(b_shape) < 2 or a.shape[-1] != b_shape[-2]:
        raise NumericsError(f"matmul needs a [..., M, K] and b [..., K, N], got {tuple(a.shape)} and {b_shape}")
    if prepared is None:
        prepared = prepare_weight(b, numerics, b_axis=b_axis)
    m, n = a.shape[-2], b_shape[-1]
    a = a.to(torch.float32)
    if numerics.tile is not None:
        rows, cols = numerics.tile
        a = _pad_to(_pad_to(a, -2, rows), -1, math.lcm(rows, cols))
    a = quantize(a, numerics.a_format, axis=a_axis)
    if not numerics.narrow_accumulator:
        pairs = _pairs(a, prepared.parts, numerics.fidelity, merged=True)
        out = pairs[0][0] @ pairs[0][1]
        for pa, pb in pairs[1:]:
            out = out + pa @ pb
    else:
        generator = None
        if numerics.rounding == "stochastic":
            generator = torch.Generator(device=a.device).manual_seed(numerics.seed)
        pairs = _pairs(a, prepared.parts, numerics.fidelity, merged=False)
        out = _narrow_accumulate(pairs, numerics, generator)
    return out[..., :m, :n]
