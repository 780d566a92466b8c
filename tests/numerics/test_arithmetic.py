"""Matmul numerics: Tenstorrent fidelity phases bit by bit, narrow accumulators against a plain loop,
promotion, stochastic rounding, operand formats along the right axis, tile padding, bad input."""

from __future__ import annotations

import pytest
import torch

from firstlight.numerics import NumericsError, quantize
from firstlight.numerics.arithmetic import FIDELITIES, MatmulNumerics, fidelity_products, matmul


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def test_defaults_are_a_plain_fp32_matmul() -> None:
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, 5, 7, generator=g), torch.randn(7, 3, generator=g)
    assert torch.equal(matmul(a, b, MatmulNumerics()), a @ b)


# a feeds SrcB (hi: 1 + 6 mantissa bits, lo: the next 4), b feeds SrcA (hi: 1 + 4, lo: the next 5)
A = 1 + 2.0**-7 + 2.0**-10  # a_hi = 1, a_lo = 2^-7 + 2^-10
B = 1 + 2.0**-5 + 2.0**-9 + 2.0**-10  # b_hi = 1, b_lo = 2^-5 + 2^-9; 2^-10 is TF32's last bit: ignored
B_USED = 1 + 2.0**-5 + 2.0**-9
FIDELITY_PRODUCT = {
    "lofi": 1.0,  # phase 0: a_hi * b_hi
    "hifi2": B_USED,  # + phase 1: a_hi * b_lo
    "hifi3": B_USED + 2.0**-7 + 2.0**-10,  # + phase 2: a_lo * b_hi
    "hifi4": A * B_USED,  # + phase 3: a_lo * b_lo
}


@pytest.mark.parametrize("fidelity", FIDELITIES)
def test_fidelity_phases_use_the_isa_operand_bits(fidelity: str) -> None:
    a, b = torch.tensor([[A]]), torch.tensor([[B]])
    out = matmul(a, b, MatmulNumerics(fidelity=fidelity))
    assert out.item() == FIDELITY_PRODUCT[fidelity]
    # the operands' roles are not symmetric: swapping them changes LoFi
    if fidelity == "lofi":
        assert matmul(b, a, MatmulNumerics(fidelity=fidelity)).item() == 1 + 2.0**-5


def test_lofi_is_one_matmul_on_truncated_operands_and_fidelity_orders_the_error() -> None:
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(32, 256, generator=g), torch.randn(256, 64, generator=g)
    ref = a.double() @ b.double()
    errs = {f: rel_err(matmul(a, b, MatmulNumerics(a_format="bf16", b_format="bf16", fidelity=f)), ref) for f in FIDELITIES}
    assert errs["lofi"] > 3 * errs["hifi2"] > 3 * errs["hifi4"] * 0.9
    assert errs["hifi3"] <= errs["hifi2"]
    assert len(fidelity_products(a, b, "lofi")) == 1 and len(fidelity_products(a, b, "hifi4")) == 1
    # HiFi4 on bf16 operands consumes every bit: the bf16 matmul itself
    a16, b16 = quantize(a, "bf16"), quantize(b, "bf16")
    hifi4 = matmul(a, b, MatmulNumerics(a_format="bf16", b_format="bf16", fidelity="hifi4"))
    assert torch.equal(hifi4, a16 @ b16)
    # LoFi: a keeps 6 mantissa bits, b keeps 4 (truncated, not rounded)
    lofi = matmul(a, b, MatmulNumerics(fidelity="lofi"))
    trunc_a = (a.view(torch.int32) & ~((1 << 17) - 1)).view(torch.float32)
    trunc_b = (b.view(torch.int32) & ~((1 << 19) - 1)).view(torch.float32)
    assert torch.equal(lofi, trunc_a @ trunc_b)


@pytest.mark.parametrize("fidelity", FIDELITIES)
def test_merged_products_equal_the_sum_of_the_hardware_phases(fidelity: str) -> None:
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(8, 48, generator=g), torch.randn(48, 8, generator=g)
    merged = sum(x.double() @ y.double() for x, y in fidelity_products(a, b, fidelity, merged=True))
    phases = fidelity_products(a, b, fidelity, merged=False)
    assert len(phases) == FIDELITIES.index(fidelity) + 1
    by_phase = sum(x.double() @ y.double() for x, y in phases)
    assert torch.allclose(merged, by_phase, rtol=0, atol=1e-12)


def reference_narrow(a: torch.Tensor, b: torch.Tensor, acc_fmt: str, chunk: int, promote: int | None) -> torch.Tensor:
    """The accumulation written out as loops: fp32 chunk dot products, narrow running sum, fp32 total."""
    m, k = a.shape
    n = b.shape[1]
    out = torch.zeros(m, n)
    for i in range(m):
        for j in range(n):
            total, acc = torch.zeros(()), torch.zeros(())
            for c, start in enumerate(range(0, k, chunk)):
                part = (a[i, start : start + chunk] * b[start : start + chunk, j]).sum()  # fp32
                acc = quantize(acc + part, acc_fmt)
                if promote and (c + 1) % (promote // chunk) == 0:
                    total, acc = total + acc, torch.zeros(())
            out[i, j] = total + acc
    return out


@pytest.mark.parametrize(("acc", "chunk", "promote"), [("bf16", 16, None), ("fp16", 16, 64), ("fp22", 32, 128)])
def test_narrow_accumulator_matches_the_loop_written_out(acc: str, chunk: int, promote: int | None) -> None:
    g = torch.Generator().manual_seed(3)
    a, b = torch.rand(3, 256, generator=g), torch.rand(256, 4, generator=g)  # positive: the sum grows
    nm = MatmulNumerics(accumulator=acc, mma_k=chunk, promotion_interval=promote)
    out = matmul(a, b, nm)
    ref = reference_narrow(a, b, acc, chunk, promote)
    assert torch.allclose(out, ref, rtol=2e-7, atol=0)  # chunk dots may sum in another order
    assert rel_err(out, a.double() @ b.double()) > 1e-7  # and the narrow format did cost precision


def test_promotion_bounds_the_error_of_a_narrow_accumulator_over_long_k() -> None:
    # DeepSeek-V3 sec. 3.3.2: ~14-bit accumulation over K=4096 loses ~2%; promoting every 128 fixes it
    g = torch.Generator().manual_seed(4)
    a, b = torch.rand(4, 4096, generator=g), torch.rand(4096, 4, generator=g)
    ref = a.double() @ b.double()
    never = MatmulNumerics(accumulator="fp22", rounding="truncate", mma_k=32)
    every_128 = MatmulNumerics(accumulator="fp22", rounding="truncate", mma_k=32, promotion_interval=128)
    e_never, e_promoted = rel_err(matmul(a, b, never), ref), rel_err(matmul(a, b, every_128), ref)
    assert e_never > 10 * e_promoted
    bf16 = rel_err(matmul(a, b, MatmulNumerics(accumulator="bf16", mma_k=16)), ref)
    assert bf16 > e_never  # 8 bits of significand are worse than 14


def test_stochastic_accumulation_is_reproducible_per_seed_and_unbiased() -> None:
    # every 16-value chunk adds 0.4; past 128 bf16's step is 1, so round-to-nearest stops growing there
    a, b = torch.full((4, 8192), 0.025), torch.ones(8192, 4)
    true = 8192 * 0.025
    rne = matmul(a, b, MatmulNumerics(accumulator="bf16", mma_k=16))
    assert (rne == 128).all()
    sr = [matmul(a, b, MatmulNumerics(accumulator="bf16", mma_k=16, rounding="stochastic", seed=s)) for s in (1, 1, 2)]
    assert torch.equal(sr[0], sr[1]) and not torch.equal(sr[0], sr[2])
    assert abs(sr[0].mean().item() - true) < 0.03 * true


def test_operand_formats_quantize_along_the_given_axis() -> None:
    g = torch.Generator().manual_seed(6)
    a, b = torch.randn(4, 64, generator=g), torch.randn(64, 32, generator=g) * torch.logspace(-2, 2, 32)
    along_k = matmul(a, b, MatmulNumerics(b_format="bfp8_b"))
    along_n = matmul(a, b, MatmulNumerics(b_format="bfp8_b"), b_axis=-1)
    assert torch.equal(along_k, a @ quantize(b, "bfp8_b", axis=0))
    assert torch.equal(along_n, a @ quantize(b, "bfp8_b", axis=-1))
    assert not torch.equal(along_k, along_n)
    assert torch.equal(matmul(a, b, MatmulNumerics(a_format="mxfp4")), quantize(a, "mxfp4") @ b)


def test_tile_padding_keeps_shapes_and_values() -> None:
    g = torch.Generator().manual_seed(7)
    a, b = torch.randn(2, 5, 40, generator=g), torch.randn(40, 9, generator=g)
    plain = MatmulNumerics(a_format="bfp8_b", b_format="bfp4_b", fidelity="hifi2")
    tiled = MatmulNumerics(a_format="bfp8_b", b_format="bfp4_b", fidelity="hifi2", tile=(32, 32))
    out = matmul(a, b, tiled)
    assert out.shape == (2, 5, 9)
    assert torch.allclose(out, matmul(a, b, plain), rtol=1e-6, atol=1e-6)
    narrow = MatmulNumerics(accumulator="bf16", mma_k=16, tile=(32, 32))
    assert torch.allclose(matmul(a, b, narrow), a @ b, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"fidelity": "hifi5"}, "fidelity"),
        ({"accumulator": "mxfp4"}, "accumulator"),
        ({"a_format": "fp7"}, "fp7"),
        ({"rounding": "stochastic"}, "seed"),
        ({"promotion_interval": 100, "mma_k": 32}, "multiple"),
        ({"tile": (32, 0)}, "tile"),
    ],
)
def test_bad_numerics_name_the_field(kwargs: dict, match: str) -> None:
    with pytest.raises(NumericsError, match=match):
        MatmulNumerics(**kwargs)


def test_shape_mismatch_is_a_numerics_error() -> None:
    with pytest.raises(NumericsError, match=r"\[\.\.\., K, N\]"):
        matmul(torch.ones(2, 3), torch.ones(4, 2), MatmulNumerics())


@pytest.mark.parametrize("fidelity", [None, "hifi3"])
def test_a_prepared_weight_gives_the_same_bits_and_must_match_the_numerics(fidelity: str | None) -> None:
    from firstlight.numerics.arithmetic import prepare_weight

    g = torch.Generator().manual_seed(8)
    a, b = torch.randn(3, 40, generator=g), torch.randn(40, 20, generator=g)
    nm = MatmulNumerics(a_format="bf16", b_format="bfp8_b", fidelity=fidelity, tile=(32, 32))
    w = prepare_weight(b, nm)
    assert torch.equal(matmul(a, w, nm), matmul(a, b, nm))
    with pytest.raises(NumericsError, match="prepared for"):
        matmul(a, w, MatmulNumerics(b_format="bfp4_b", fidelity=fidelity, tile=(32, 32)))
