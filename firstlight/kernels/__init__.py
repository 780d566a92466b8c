"""firstlight's own CPU kernels, one extension built once per machine at first use, from csrc/:
int4_gemv.cpp (int4 and int8 weights), int4_vnni.cpp (w4a8 on its tiled layout: AVX-512 VNNI or AVX2),
f32_gemm.cpp (fp32 weights: tiles on nn.Linear's layout, and packed panels), paged_attention.cpp (decode
attention over the paged KV pools, and prefill attention over gathered keys), dense_decode.cpp (a dense
decoder's whole decode step, engine/native_decode.py, and the one-pass norm, rope and gated activation a
prefill runs), sampling.cpp (the sampler's categorical draw); firstlight_kernels.h holds what they share.

`torch.utils.cpp_extension.load` compiles them into `$FIRSTLIGHT_HOME/kernels/<name>` (-O3 -fopenmp, plus
-mavx2 -mfma -mf16c when torch reports an AVX2 CPU, and the AVX-512 VNNI flags when the CPU has them: ISA
avx512vnni) and loads the torch ops `firstlight::int4_mm`, `int8_mm`, `f32_mm`, `f32_mm_packed`,
`paged_decode_attention`, `attention`, `dense_decode`, ... (registered in C++ with TORCH_LIBRARY, so an eager
call costs one dispatcher hop, not a Python one; `register_fake` here gives torch.compile their shapes, so a
compiled decode keeps each call as one opaque node).

FIRSTLIGHT_CPU_KERNELS (FIRSTLIGHT_INT4_KERNEL, its earlier name, is read when it is unset): `auto` (default)
uses ours if it builds, else torch's kernels with one warning; `aten` forces torch's; `firstlight` requires ours
(a QuantizationError naming what failed otherwise).
"""

from __future__ import annotations

import hashlib
import os
import re
import warnings
from pathlib import Path

import torch

from firstlight.quant.registry import QuantizationError

ENV = "FIRSTLIGHT_CPU_KERNELS"
OLD_ENV = "FIRSTLIGHT_INT4_KERNEL"  # the switch's name while the extension held only the int4 kernel
ISA_ENV = "FIRSTLIGHT_CPU_KERNELS_ISA"  # force one of ISAS: `scalar` the portable path (its tests), `avx2` on a VNNI CPU
MODES = ("auto", "aten", "firstlight")
SOURCE = Path(__file__).parent / "csrc" / "int4_gemv.cpp"
SOURCES = (SOURCE, *(SOURCE.with_name(n) for n in ("int4_vnni.cpp", "f32_gemm.cpp", "paged_attention.cpp", "dense_decode.cpp",
                                                   "sampling.cpp")))
ISAS = ("avx512vnni", "avx2", "scalar")
VNNI_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni")  # /proc/cpuinfo names
VNNI_TILE = 16  # output rows per int32 register of the VNNI layout (pack_int4_vnni)
TILED_ISAS = ("avx512vnni", "avx2")  # the builds whose int4_mm_a8 takes that layout (int4_vnni.cpp)
HEADERS = (SOURCE.with_name("firstlight_kernels.h"),)
BLOCK = 32  # input channels per 16-byte block of nibbles
# Above this many activation rows, int4_mm dequantizes slabs and multiplies each on our fp32 panels (AVX-512
# builds; the BLAS elsewhere); from 6 rows up to it, the dequantized-panel tiles. At 2 threads (with the kernels
# built with OpenMP) a 128-token prefill of SmolLM2 int4 took 313 ms with the tiles vs 441 ms through the BLAS; on
# the AVX-512 build the tiles and the dequantized slabs on panels tie at 128 rows (211 / 212 ms a forward) and
# the tiles win at 32 (65 vs 128 ms). int4_mm_a8's own tiles keep 16.
MAX_TILED_M = 128
A8_MAX_TILED_M = 16
# int8_mm: the register tiles (fp32 activations) beat dequantize + mm up to at least 128 rows at 1 thread (the
# head, 49152 x 576: 86 / 111 ms vs 106 / 142 ms at M = 96 / 128), not at 2 (53 vs 85 GFLOP/s at M = 128)
INT8_MAX_TILED_M = 64
# f32_mm: up to this many rows our tiles beat the BLAS on cold weights (benchmarks/f32_gemm.py); above, at::mm
F32_MAX_TILED_M = 32
# The builds whose fp32 linears run on f32_mm_packed's panels at every row count (quant/f32.py): its micro-kernel
# is AVX-512's; elsewhere f32_mm's tiles and oneDNN stay (the packed op still runs there, portably, for tests)
F32_PANEL_ISAS = ("avx512vnni",)
F32_PANEL = 32  # output columns per panel of f32_pack's layout

_state: dict[str, object] = {}
_fakes: list[bool] = []  # register_fake once per process, however often the load is re-decided
# The ISA of the library this process loaded: TORCH_LIBRARY(firstlight) may be registered once per process,
# so a second load (another FIRSTLIGHT_HOME, after reset_for_tests) would abort; it reuses the first.
_loaded: list[str] = []


def kernel_mode() -> str:
    mode = (os.environ.get(ENV) or os.environ.get(OLD_ENV) or "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise QuantizationError(f"{ENV}={mode!r} is not one of {', '.join(MODES)}")
    return mode


def cpu_has_avx2() -> bool:
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def cpu_has_avx512_vnni(cpuinfo: str | None = None) -> bool:
    """AVX-512 F/BW/VL/DQ and VNNI (Linux: the kernel's cpuinfo flags, or the text given; elsewhere False)."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        return False
    try:
        text = Path("/proc/cpuinfo").read_text() if cpuinfo is None else cpuinfo
    except OSError:
        return False
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(VNNI_FLAGS) <= set(line.split())


def default_isa() -> str:
    return "avx512vnni" if cpu_has_avx512_vnni() else "avx2" if cpu_has_avx2() else "scalar"


def _build() -> str:
    """Compile (or reuse) and load the extension; returns the ISA it was built for."""
    from torch.utils import cpp_extension

    from firstlight.models.hub import firstlight_home

    isa = os.environ.get(ISA_ENV) or default_isa()
    if isa not in ISAS:
        raise QuantizationError(f"{ISA_ENV}={isa!r} is not one of {', '.join(ISAS)}")
    if _loaded:
        return _loaded[0]
    # -fopenmp: at::parallel_for is a header template that runs its body serially unless the including source is
    # compiled with OpenMP; the .so then links libgomp.so.1, the runtime torch already loaded (one thread pool,
    # torch.set_num_threads applies). Without it every kernel here ran on one core whatever the thread count.
    flags = ["-O3", "-fopenmp"] + (["-mavx2", "-mfma", "-mf16c"] if isa != "scalar" else [])
    if isa == "avx512vnni":  # the VNNI layout's kernel (int4_vnni.cpp); the rest stays on its AVX2 paths
        flags += ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mprefer-vector-width=256"]
    tag = hashlib.sha256(("".join(p.read_text() for p in (*SOURCES, *HEADERS)) + " ".join(flags)).encode()).hexdigest()[:10]
    torch_tag = re.sub(r"[^0-9A-Za-z]+", "_", torch.__version__)
    name = f"firstlight_cpu_{isa}_{tag}"
    build_dir = firstlight_home() / "kernels" / f"{name}_torch{torch_tag}"
    build_dir.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(
        name=name, sources=[str(p) for p in SOURCES], extra_cflags=flags, extra_ldflags=["-fopenmp"], build_directory=str(build_dir),
        is_python_module=False, verbose=False,
    )
    _loaded.append(isa)
    if not _fakes:
        _register_fakes()
        _fakes.append(True)
    return isa


def _register_fakes() -> None:
    @torch.library.register_fake("firstlight::int4_mm")
    def _(x, packed, scales, mins, group_size, max_tiled_m):  # noqa: ANN001, ANN202
        return x.new_empty((x.shape[0], packed.shape[0]), dtype=torch.float32)

    @torch.library.register_fake("firstlight::int4_mm_a8")
    def _(x, packed, scales, mins, group_size, max_tiled_m):  # noqa: ANN001, ANN202
        n = packed.shape[0] * (VNNI_TILE if packed.dim() == 3 else 1)
        return x.new_empty((x.shape[0], n), dtype=torch.float32)

    @torch.library.register_fake("firstlight::int8_mm")
    def _(x, qweight, scales, act_int8, max_tiled_m):  # noqa: ANN001, ANN202
        return x.new_empty((x.shape[0], qweight.shape[0]), dtype=torch.float32)

    @torch.library.register_fake("firstlight::f32_mm")
    def _(x, w, bias, max_tiled_m):  # noqa: ANN001, ANN202
        return x.new_empty((x.shape[0], w.shape[0]), dtype=torch.float32)

    @torch.library.register_fake("firstlight::f32_pack")
    def _(w):  # noqa: ANN001, ANN202
        return w.new_empty(((w.shape[0] + F32_PANEL - 1) // F32_PANEL, w.shape[1], F32_PANEL))

    @torch.library.register_fake("firstlight::f32_mm_packed")
    def _(x, packed, n, bias):  # noqa: ANN001, ANN202
        return x.new_empty((x.shape[0], n))

    @torch.library.register_fake("firstlight::gated_act")
    def _(gate_up, act):  # noqa: ANN001, ANN202
        return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))

    @torch.library.register_fake("firstlight::rms_norm")
    def _(x, w, eps):  # noqa: ANN001, ANN202
        return x.new_empty(x.shape)

    @torch.library.register_fake("firstlight::rope")
    def _(x, cos, sin):  # noqa: ANN001, ANN202
        b, h, s, d = x.shape
        return x.new_empty((b, s, h, d)).permute(0, 2, 1, 3)

    @torch.library.register_fake("firstlight::paged_decode_attention")
    def _(q, k_pool, v_pool, slots, mask, scale):  # noqa: ANN001, ANN202
        return q.new_empty(q.shape)

    @torch.library.register_fake("firstlight::attention")
    def _(q, k, v, mask, causal, scale):  # noqa: ANN001, ANN202
        b, h, s, d = q.shape
        return q.new_empty((b, s, h, d)).permute(0, 2, 1, 3)

    @torch.library.register_fake("firstlight::argmax_rows")
    def _(logits):  # noqa: ANN001, ANN202
        return logits.new_empty((logits.shape[0],), dtype=torch.long)

    @torch.library.register_fake("firstlight::sample_rows")
    def _(logits, rows, inv_temp, u):  # noqa: ANN001, ANN202
        return rows.new_empty(rows.shape)

    @torch.library.register_fake("firstlight::int4_dequant")
    def _(packed, scales, mins, group_size):  # noqa: ANN001, ANN202
        if packed.dim() == 3:
            return scales.new_empty((packed.shape[0] * VNNI_TILE, packed.shape[1] * 8), dtype=torch.float32)
        return scales.new_empty((packed.shape[0], packed.shape[1] * 2), dtype=torch.float32)


def load_kernel() -> str | None:
    """The ISA of our loaded kernel ('avx512vnni', 'avx2' or 'scalar'), or None when torch's aten kernel is to be used.

    Built at most once per process (and compiled at most once per machine); a failure warns once
    (mode auto) or raises (mode firstlight).
    """
    mode = kernel_mode()
    if mode == "aten":
        return None
    if "isa" not in _state:
        try:
            _state["isa"] = _build()
        except Exception as e:  # noqa: BLE001 - any build failure means: use aten (or say why not)
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            _state["isa"] = None
            _state["error"] = f"{type(e).__name__}: {first}"
            if mode == "auto":
                warnings.warn(
                    f"firstlight int4 kernel did not build ({_state['error']}); using torch's "
                    f"aten._weight_int4pack_mm_for_cpu (set {ENV}=aten to silence)", RuntimeWarning, stacklevel=2,
                )
    if _state["isa"] is None and mode == "firstlight":
        raise QuantizationError(
            f"{ENV}=firstlight but the int4 kernel {SOURCE.name} could not be built: {_state.get('error')}; "
            "install a C++ compiler and ninja, or unset it"
        )
    return _state["isa"]  # type: ignore[return-value]


def reset_for_tests() -> None:
    """Forget the load outcome (the built library stays loaded): tests switch modes."""
    _state.clear()


def pack_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> tuple[torch.Tensor, ...]:
    """quantize_groupwise_int4's (Q [N, K] 0..15, scale [K/G, N], zero [K/G, N]) -> our layout:
    packed uint8 [N, K/2] (byte j of each 32-channel block = q[j] | q[16 + j] << 4), d [N, K/G] = scale,
    m [N, K/G] = zero - 8 * scale, all fp32, so that w = fma(q, d, m)."""
    n, k = q.shape
    if k % BLOCK or group_size % BLOCK or k % group_size:
        raise QuantizationError(f"int4 kernel needs K and group_size multiples of {BLOCK}, got K={k}, G={group_size}")
    blocks = q.to(torch.uint8).reshape(n, k // BLOCK, 2, BLOCK // 2)
    packed = (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2).contiguous()
    d = scale.t().float().contiguous()
    m = (zero.t().float() - 8 * d).contiguous()
    return packed, d, m


def pack_int4_vnni(packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """pack_int4's layout -> w4a8's tiled (VNNI) one (csrc/int4_vnni.cpp; avx512vnni and avx2 builds): packed
    uint8 [N/16, K/8, 64], byte 4r + j of octet o in tile c = q[16c + r, 8o + j] | q[16c + r, 8o + 4 + j] << 4;
    d, m [N/16, K/G, 16]. N % 16 == 0."""
    n, half = packed.shape
    if n % VNNI_TILE:
        raise QuantizationError(f"the VNNI int4 layout needs N a multiple of {VNNI_TILE}, got {n}")
    k = half * 2
    blocks = packed.reshape(n, k // BLOCK, BLOCK // 2)
    q = torch.cat([blocks & 0xF, blocks >> 4], dim=2).reshape(n, k)  # codes in channel order
    q = q.reshape(n // VNNI_TILE, VNNI_TILE, k // 8, 2, 4).permute(0, 2, 3, 1, 4)  # [tile, octet, half, row, j]
    vnni = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n // VNNI_TILE, k // 8, 4 * VNNI_TILE).contiguous()

    def tiles(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(n // VNNI_TILE, VNNI_TILE, -1).transpose(1, 2).contiguous()

    return vnni, tiles(d), tiles(m)


def int4_mm(x: torch.Tensor, packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor, group_size: int) -> torch.Tensor:
    """x [M, K] (any float dtype) -> fp32 [M, N]."""
    return torch.ops.firstlight.int4_mm(x, packed, d, m, group_size, MAX_TILED_M)


def int4_mm_a8(x: torch.Tensor, packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor, group_size: int) -> torch.Tensor:
    """x [M, K] -> fp32 [M, N] = W~ x^, x^ = x rounded to int8 per block of 32 (quantize_act_int8): integer dot
    products per block, as llama.cpp's Q4_1 x Q8_1."""
    return torch.ops.firstlight.int4_mm_a8(x, packed, d, m, group_size, A8_MAX_TILED_M)


def int8_mm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, act_int8: bool = False) -> torch.Tensor:
    """Per-row int8 weight (aten._weight_int8pack_mm's layout: q int8 [N, K], scales [N]; K % 32 == 0) times
    x [M, K] -> fp32 [M, N]; with act_int8, x is first rounded as quantize_act_int8."""
    return torch.ops.firstlight.int8_mm(x, qweight, scales, act_int8, INT8_MAX_TILED_M)


def f32_mm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T + bias in fp32 (nn.Linear's layout): our tiles up to F32_MAX_TILED_M rows, at::mm above."""
    return torch.ops.firstlight.f32_mm(x, w, bias, F32_MAX_TILED_M)


GATED_ACTS = {"silu": 0, "gelu_pytorch_tanh": 1}  # dense_decode.cpp Act


def f32_pack(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] fp32 in panels of 32 output columns, [ceil(N / 32), K, 32] (zero-padded): f32_mm_packed's layout."""
    return torch.ops.firstlight.f32_pack(w)


def f32_mm_packed(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ w^T + bias in fp32, w given as f32_pack(w) of its N = n output rows."""
    return torch.ops.firstlight.f32_mm_packed(x, packed, n, bias)


def f32_panels() -> bool:
    """True where fp32 linears run on f32_mm_packed at every row count (an AVX-512 build of the extension)."""
    return load_kernel() in F32_PANEL_ISAS


def gated_act(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """act(gate) * up of gate_up [..., 2I] (gate first) -> [..., I] fp32, in one pass; act in GATED_ACTS."""
    return torch.ops.firstlight.gated_act(gate_up, GATED_ACTS[act])


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """w * (x / sqrt(mean(x^2) + eps)) over the last dim of fp32 x [..., E], w [E] (models/layers.py RMSNorm)."""
    return torch.ops.firstlight.rms_norm(x, w, eps)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """models/layers.py apply_rope of fp32 x [B, H, S, D] with cos, sin [B or 1, 1, S, Dr] -> [B, H, S, D] (laid
    out [B, S, H, D])."""
    return torch.ops.firstlight.rope(x, cos, sin)


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor,
                           mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """One query token per row, q [B, H, D], over its keys in place: pools [slots, Hkv, D], slots [B, L] (the
    row's key slots), mask [B, L] (True = visible; None = all) -> [B, H, D] (zeros for a row that sees none)."""
    return torch.ops.firstlight.paged_decode_attention(q, k_pool, v_pool, slots, mask, scale)


def paged_slots(table: torch.Tensor, context: torch.Tensor, lo: torch.Tensor, positions: torch.Tensor, num_keys: int,
                block_size: int, pad: int, scratch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One KV cache group's slots for a forward: table [B, blocks] block ids, a row's keys at positions lo[b] ..
    context[b] - 1, the new tokens at positions [B, S], num_keys keys per row, `pad` padding rows (they write to
    `scratch` and see no key) -> (write slots [(B + pad) * S], gather slots [B + pad, num_keys] (0 past a row's
    keys), key positions [B + pad, num_keys] (-1 there)); the slot of position t is table[b, t // bs] * bs + t % bs."""
    write, gather, keys = torch.ops.firstlight.paged_slots(table, context, lo, positions, num_keys, block_size, pad,
                                                           scratch)
    return write, gather, keys


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
              scale: float) -> torch.Tensor:
    """SDPA with GQA for fp32 on CPU: q [B, H, S, D] over k, v [B, Hkv, L, D] (H a multiple of Hkv) -> [B, H, S, D]
    (laid out [B, S, H, D]). mask: boolean [B, 1, S, L] or [B, S, L] (True = visible); without one, causal
    (query i sees keys j <= L - S + i) or, causal False, every key. A query that sees no key gets zeros."""
    return torch.ops.firstlight.attention(q, k, v, mask, causal, scale)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, -1) of fp32 [N, V] with contiguous rows (the first maximum, the first NaN of a row)."""
    return torch.ops.firstlight.argmax_rows(logits)


def sample_rows(logits: torch.Tensor, rows: torch.Tensor, inv_temp: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One categorical draw per selected row: logits [N, V] fp32, rows [R] int64, inv_temp [R] fp32 (1 / temperature;
    -inf logits weigh 0), u [R] fp64 in [0, 1) -> [R] int64, the first token whose cumulative probability exceeds u
    (engine/sampler.py inverse_cdf's draw on softmax(logits * inv_temp), without materializing it)."""
    return torch.ops.firstlight.sample_rows(logits, rows, inv_temp, u)


def quantize_act_int8(x: torch.Tensor) -> torch.Tensor:
    """Reference of the kernel's activation rounding: x [M, K] fp32 -> x^ = dx * round(x * 127 / amax) per
    block of 32 channels, dx = amax / 127 (fp32 ops in the kernel's order)."""
    xb = x.float().reshape(x.shape[0], -1, BLOCK)
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(xb * inv) * (amax / 127.0)).reshape(x.shape)


def int4_dequant(packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor, group_size: int) -> torch.Tensor:
    """The fp32 weight [N, K] the kernel multiplies by (the same fma per weight)."""
    return torch.ops.firstlight.int4_dequant(packed, d, m, group_size)
