"""w8a8: int8 weights (symmetric per output channel) x int8 activations (dynamic, symmetric per token),
multiplied in integers by fbgemm, the CPU int8 GEMM that torch ships (`torch.ops.quantized`).

    s_w[n]  = max_k |W[n, k]| / Qw                       (per output channel, at load)
    Wq[n,k] = clamp(round(W[n, k] / s_w[n]), -Qw, Qw)    int8
    s_x[m]  = max_k |x[m, k]| / Qx                       (per token, at run time)
    X[m,k]  = round(x[m, k] / s_x[m])                    in -Qx..Qx
    y[m,n]  = s_x[m] * s_w[n] * sum_k X[m, k] Wq[n, k] + b[n]     (the sum is exact, in int32)

The kernel: `quantized::linear_with_input_q_dq_qweight_dq_output_fp32(x, x_scale, x_zero_point, packed)`
quantizes x with *one* scale and zero point, runs fbgemm's uint8 x int8 GEMM with int32 accumulation
and returns fp32 with the per-channel weight scales applied. Per-token scales go through that
per-tensor kernel by dividing each row by its own s_x first: the kernel then sees values already in
-Qx..Qx, quantizes them with scale 1 and zero point Qx + 1 (so its rounding *is* the per-token
rounding, exactly), and the fp32 output is multiplied by s_x[m] row by row. One scale per token means
a token's result does not depend on which other tokens share its batch.

Why fbgemm (torch 2.13, this 2-core AVX2 CPU without VNNI, 1 thread, [32, 576] x [576, 1536]):
fp32 `F.linear` ~0.96 ms, this kernel ~0.43 ms; `torch._int_mm` has only a reference CPU loop
(~100 ms); oneDNN's `onednn.qlinear_pointwise` refuses per-token scales ("act scale/zp size should
be 1") and took ~1.1 ms at per-tensor scale. (`benchmarks/quant_speed.py` measures the formats.)

Why 7-bit weights without VNNI (`weight_bits=7`: Qw = 63, Qx = 127): there fbgemm multiplies with AVX2
`vpmaddubsw`, which adds each pair of uint8 x int8 products into an int16 *with saturation*. With uint8
activations up to 255 and weights up to +-127 a pair reaches 64,770 > 32,767, and on SmolLM2-135M's
layers the result differed from exact integer arithmetic by 1-4 % (relative norm). Either side at 7 bits
keeps every pair under 2^15 - 1 (255 x 63 x 2 = 32,130; 127 x 127 x 2 = 32,258), and the output then
equals the exact integer result to fp32 rounding (measured 5e-8). `weight_bits=8` keeps 8-bit weights and
takes 7-bit activations instead (Qx = 63). PyTorch's own dynamic quantization narrows the activations the
same way (`reduce_range=True`), per tensor. Where fbgemm runs its AVX-512 VNNI kernels (`vpdpbusd` adds
in int32: no saturation; `fbgemm_exact_8x8()` probes the worst case, every code 127, once), `weight_bits=8`
keeps both sides at 8 bits (Qw = Qx = 127), and it is the default there. With GPTQ, the 16 input channels of
largest calibration mean square stay in fp32 (`num_exact_channels`; 8 until 2026-12-02: on the AVX-512 VNNI
EPYC that default's perplexity ratio on SmolLM2-135M was 1.0105, above the issue's 1.01; 8-bit codes with 16
exact channels: 1.0086, mean KL 0.0098 -> 0.0060; docs/QUANT.md).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from firstlight.quant.base import QuantizedModule
from firstlight.quant.int8 import Int8ChannelGrid, quantize_per_channel_int8
from firstlight.quant.registry import QuantFormat, QuantizationError, register_format, unsupported

WEIGHT_BITS = (7, 8)
KERNEL = "fbgemm int8 GEMM (quantized::linear_with_input_q_dq_qweight_dq_output_fp32), per-token activations"


@functools.cache
def fbgemm_exact_8x8() -> bool:
    """Whether fbgemm's uint8 x int8 GEMM stays exact with 8-bit codes on both sides on this CPU (its VNNI
    kernels) rather than saturating pairs of products in int16 (AVX2's vpmaddubsw): every code at 127, at
    a decode-sized, a batch-sized and a prefill-sized row count (fbgemm picks its kernel by shape too)."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return False
    n = 32
    with _fbgemm_engine(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensor creation is deprecated (still the way to pack)
        for m, k in ((1, 64), (33, 576), (300, 256)):
            qweight = torch.quantize_per_channel(torch.full((n, k), 127.0), torch.ones(n, dtype=torch.double),
                                                 torch.zeros(n, dtype=torch.long), 0, torch.qint8)
            packed = torch.ops.quantized.linear_prepack(qweight, None)
            y = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
                torch.full((m, k), 127.0), 1.0, 128, packed)
            if not bool((y == 127 * 127 * k).all()):
                return False
    return True


def qmax_pair(weight_bits: int) -> tuple[int, int]:
    """(Qw, Qx): the largest weight and activation code; one side is 7-bit where vpmaddubsw could saturate."""
    if weight_bits == 7:
        return 63, 127
    return (127, 127) if fbgemm_exact_8x8() else (127, 63)


@contextlib.contextmanager
def _fbgemm_engine() -> Iterator[None]:
    """Pack for fbgemm whatever the process-wide quantized engine is, and put it back."""
    before = torch.backends.quantized.engine
    torch.backends.quantized.engine = "fbgemm"
    try:
        yield
    finally:
        torch.backends.quantized.engine = before


def pack_weight(q: torch.Tensor, scale: torch.Tensor) -> Any:
    """int8 codes [N, K] and scales [N] -> fbgemm's packed weight (a torch ScriptObject)."""
    zero = torch.zeros(q.shape[0], dtype=torch.long)
    with warnings.catch_warnings():  # quantized tensors are deprecated as a user API; the kernel takes one
        warnings.simplefilter("ignore")
        wq = torch._make_per_channel_quantized_tensor(q, scale.double(), zero, 0)
        with _fbgemm_engine():
            return torch.ops.quantized.linear_prepack(wq, None)


def unpack_weight(packed: Any) -> torch.Tensor:
    """The int8 codes [N, K] inside a packed weight."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wq, _ = torch.ops.quantized.linear_unpack(packed)
        return wq.int_repr()


class W8A8Linear(QuantizedModule):
    """The packed int8 weight lives in fbgemm's layout only (no second copy of the codes); the state
    dict still carries `qweight` (int8 codes), unpacked on save and repacked on load."""

    def __init__(
        self, linear: nn.Linear, weight_bits: int, kernel: str, params: tuple[torch.Tensor, ...] | None = None
    ) -> None:
        """params: (scale [N],) or (scale [N], exact input channels [k]) from a calibrated method (GPTQ,
        whose weights lie on that grid except in the exact channels)."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_bits, self.kernel = weight_bits, kernel
        self.weight_qmax, self.act_qmax = qmax_pair(weight_bits)
        w = linear.weight.detach().float()
        exact = params[1].long() if params is not None and len(params) > 1 else torch.zeros(0, dtype=torch.long)
        self.register_buffer("exact_idx", exact)  # [k] input channels multiplied in fp32 (LLM.int8() outliers)
        self.register_buffer("exact_weight_t", w[:, exact].t().contiguous())  # [k, N]
        w = w.index_fill(1, exact, 0.0)
        q, scale = quantize_per_channel_int8(w, None if params is None else params[0], qmax=self.weight_qmax)
        self.register_buffer("weight_scale", scale)  # [N] fp32
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().clone())
        self.packed = pack_weight(q, scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).float()  # [M, K]
        x_exact = None
        if self.exact_idx.numel():
            x_exact = x2.index_select(1, self.exact_idx)  # [M, k]
            x2 = x2.index_fill(1, self.exact_idx, 0.0)
        s = x2.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / self.act_qmax  # [M, 1] per-token scale
        # x2 / s lies in -Qx..Qx: the kernel rounds it with scale 1 (the per-token rounding) and zero point Qx + 1
        y = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(x2 / s, 1.0, self.act_qmax + 1, self.packed)
        y = y * s  # [M, N]
        if x_exact is not None:
            y = torch.addmm(y, x_exact, self.exact_weight_t)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def dequantized_weight(self) -> torch.Tensor:
        w = unpack_weight(self.packed).float() * self.weight_scale[:, None]
        w[:, self.exact_idx] = self.exact_weight_t.t()
        return w

    def opaque_bytes(self) -> int:
        return self.in_features * self.out_features  # the int8 codes inside the packed weight

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "qweight"] = unpack_weight(self.packed)

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any) -> None:
        q = state_dict.pop(prefix + "qweight", None)
        for name in ("exact_idx", "exact_weight_t"):  # their shape depends on the calibration: take them as saved
            if prefix + name in state_dict:
                setattr(self, name, torch.empty_like(state_dict[prefix + name]))
        super()._load_from_state_dict(state_dict, prefix, *args)
        if q is not None:
            self.packed = pack_weight(q.to(torch.int8), self.weight_scale)

    def extra_repr(self) -> str:
        return (f"{self.in_features} -> {self.out_features}, w int8 (|q| <= {self.weight_qmax}) per channel, "
                f"x int8 (|q| <= {self.act_qmax}) per token, {self.kernel}")


@register_format
class W8A8(QuantFormat):
    name = "w8a8"
    summary = "int8 weights per output channel x int8 activations per token (dynamic), fbgemm int8 GEMM"
    # A tied head stays w8a8 (its own packed copy; the embedding keeps int8 rows): the int8 weight-only
    # kernel is the slowest path at batch 32 on CPU (docs/QUANT.md), w8a8 the fastest.
    int8_tied_head = False

    def __init__(self, weight_bits: int | None = None, num_exact_channels: int = 16, **opts: Any) -> None:
        super().__init__(**opts)
        if weight_bits is None:  # 8-bit codes on both sides where fbgemm cannot saturate, else 7-bit weights
            weight_bits = 8 if fbgemm_exact_8x8() else 7
        if weight_bits not in WEIGHT_BITS:
            raise QuantizationError(f"w8a8 weight_bits must be one of {WEIGHT_BITS}, got {weight_bits}")
        if num_exact_channels < 0:
            raise QuantizationError(f"w8a8 num_exact_channels must be >= 0, got {num_exact_channels}")
        self.weight_bits, self.num_exact_channels = weight_bits, num_exact_channels

    def exact_channels(self, hessian: torch.Tensor) -> torch.Tensor | None:
        """The input channels with the largest mean square activation (diag of the calibration Hessian),
        kept out of the int8 GEMM and multiplied in fp32 (LLM.int8(), Dettmers et al. 2022)."""
        k = min(self.num_exact_channels, hessian.shape[0] // 4)
        if k == 0:
            return None
        return torch.topk(torch.diagonal(hessian), k).indices.sort().values

    def kernel_path(self, device: torch.device, dtype: torch.dtype) -> str:
        if device.type != "cpu":
            raise unsupported(self.name, device, dtype, "only fbgemm's CPU int8 GEMM is wired (no GPU int8 path yet)")
        if "fbgemm" not in torch.backends.quantized.supported_engines:
            raise unsupported(self.name, device, dtype, "this torch build has no fbgemm quantized engine")
        qw, qx = qmax_pair(self.weight_bits)
        return f"{KERNEL}; |w| <= {qw}, |x| <= {qx}"

    def grid(self, device: torch.device, dtype: torch.dtype) -> Int8ChannelGrid:
        return Int8ChannelGrid(torch.float32, qmax=qmax_pair(self.weight_bits)[0])

    def quantize_linear(self, linear: nn.Linear, params: tuple[torch.Tensor, ...] | None = None) -> nn.Module:
        device, dtype = linear.weight.device, linear.weight.dtype
        kernel = self.kernel_path(device, dtype)
        if linear.weight.ndim != 2:
            raise QuantizationError(f"w8a8: expected a 2-D weight, got {tuple(linear.weight.shape)}")
        return W8A8Linear(linear, self.weight_bits, kernel, params)
