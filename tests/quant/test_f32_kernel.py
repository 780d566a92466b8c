"""firstlight::f32_mm (kernels/csrc/f32_gemm.cpp): x @ w^T + bias in fp32 for every row count (tiles of 1-3
rows x 4 output rows, the tails of N and K, the BLAS above the row limit), firstlight::f32_mm_packed on f32_pack's
panels (blocks of 1-12 rows, the tails of N, chunks of 192 rows), F32Linear as a drop-in nn.Linear (same
parameters, tied head stays tied) on the panels of an AVX-512 build or oneDNN's matmul on a reordered weight above
its row limit (either copy remade when the weight changes in place), firstlight::gated_act for GatedMLP's act(gate) * up, firstlight::rms_norm and
rope for the norms and the attention's rotary embedding, off with the aten switch (one node under torch.compile:
in test_int4_kernel.py with the other ops)."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

from firstlight import kernels
from firstlight.models.layers import (
    ACTIVATIONS,
    Attention,
    GatedMLP,
    GemmaRMSNorm,
    RMSNorm,
    apply_rope,
    rope_cos_sin,
)
from firstlight.models.loader import load_model
from firstlight.models.tiny import write_tiny_checkpoint
from firstlight.quant import f32
from firstlight.quant.f32 import (
    F32Linear,
    FusedGatedMLP,
    FusedGemmaRMSNorm,
    FusedRMSNorm,
    KernelAttention,
    onednn_min_rows,
    use_f32_kernel,
)

from .test_int4_kernel import kernel_isa, mode  # noqa: F401 - fixtures


@pytest.fixture()
def no_panels(monkeypatch: pytest.MonkeyPatch) -> None:
    """F32Linear as a build without AVX-512 runs it: f32_mm's tiles, oneDNN above its row limit."""
    monkeypatch.setattr(kernels, "F32_PANEL_ISAS", ())


@pytest.fixture()
def panels(kernel_isa: str) -> None:  # noqa: F811
    if not kernels.f32_panels():
        pytest.skip(f"the {kernel_isa} build runs fp32 linears on f32_mm and oneDNN, not on panels")


@pytest.mark.parametrize("n,k", [(64, 128), (37, 96), (5, 44), (130, 576), (3, 8)])
@pytest.mark.parametrize("m", [0, 1, 2, 3, 4, 5, 7, 8, 17, 32, 33])  # 33 > F32_MAX_TILED_M: at::mm
@pytest.mark.parametrize("with_bias", [False, True])
def test_f32_mm_equals_fp64_matmul(kernel_isa, m, n, k, with_bias):  # noqa: F811
    torch.manual_seed(m * 1000 + n + k)
    x, w = torch.randn(m, k), torch.randn(n, k)
    b = torch.randn(n) if with_bias else None
    ref = x.double() @ w.double().t() + (b.double() if with_bias else 0)
    got = kernels.f32_mm(x, w, b)
    assert got.shape == (m, n) and got.dtype == torch.float32
    if m:
        # fp32 sums of k products: |error| <= ~k * eps * sum|x w|, far inside this bound
        bound = 1e-5 * (x.double().abs() @ w.double().abs().t()).max().item() + 1e-6
        assert (got.double() - ref).abs().max().item() < bound


@pytest.mark.parametrize("n,k", [(64, 128), (37, 96), (5, 44), (33, 576), (1, 8), (96, 1)])
# 1..12: one block; 13..: balanced blocks of <= 12 (25 = 9 + 8 + 8); 193, 400: chunks of 192 rows
@pytest.mark.parametrize("m", [0, 1, 2, 7, 11, 12, 13, 25, 32, 64, 193, 400])
@pytest.mark.parametrize("with_bias", [False, True])
def test_f32_mm_packed_equals_fp64_matmul(kernel_isa, m, n, k, with_bias):  # noqa: F811
    """On every build (AVX-512's micro-kernel, the portable loop elsewhere)."""
    torch.manual_seed(m * 1000 + n + k)
    x, w = torch.randn(m, k), torch.randn(n, k)
    b = torch.randn(n) if with_bias else None
    packed = kernels.f32_pack(w)
    assert packed.shape == ((n + 31) // 32, k, 32)
    assert torch.equal(packed.transpose(1, 2).reshape(-1, k)[:n], w)  # panel p, input k, column j = w[32 p + j, k]
    assert not packed.transpose(1, 2).reshape(-1, k)[n:].any()  # the last panel's padding columns are zeros
    got = kernels.f32_mm_packed(x, packed, n, b)
    assert got.shape == (m, n) and got.dtype == torch.float32
    if m:
        ref = x.double() @ w.double().t() + (b.double() if with_bias else 0)
        bound = 1e-5 * (x.double().abs() @ w.double().abs().t()).max().item() + 1e-6
        assert (got.double() - ref).abs().max().item() < bound


def test_f32_mm_packed_names_a_wrong_layout(kernel_isa):  # noqa: F811
    w = torch.randn(40, 16)
    with pytest.raises(RuntimeError, match="f32_pack's"):
        kernels.f32_mm_packed(torch.randn(2, 16), w, 40)  # the weight itself, not its panels
    with pytest.raises(RuntimeError, match=r"x must be \[M, 16\]"):
        kernels.f32_mm_packed(torch.randn(2, 15), kernels.f32_pack(w), 40)
    with pytest.raises(RuntimeError, match="bias must have 40"):
        kernels.f32_mm_packed(torch.randn(2, 16), kernels.f32_pack(w), 40, torch.randn(39))


@pytest.mark.parametrize("rows", [1, 9, 32, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linears_of_an_avx512_build_run_on_panels(panels, mode, rows, with_bias):  # noqa: F811
    """Every row count on the panels; the copy outside the module (state_dict, deepcopy, torch.save untouched),
    remade when the weight changes in place, and under inference_mode (no version counter)."""
    mode("auto")
    torch.manual_seed(rows)
    lin = nn.Linear(96, 40, bias=with_bias).requires_grad_(False)
    use_f32_kernel(lin)
    x = torch.randn(2, rows, 96)
    ref = x.double() @ lin.weight.double().t() + (lin.bias.double() if with_bias else 0)
    got = lin(x)
    assert got.shape == (2, rows, 40) and f32._PREPARED[lin][1].shape == (2, 96, 32)
    assert list(lin.state_dict()) == (["weight", "bias"] if with_bias else ["weight"])
    assert torch.equal(copy.deepcopy(lin)(x), got)
    torch.save(lin, io.BytesIO())
    bound = 1e-5 * (x.double().abs() @ lin.weight.double().abs().t()).max().item() + 1e-6
    assert (got.double() - ref).abs().max().item() < bound
    with torch.no_grad():
        lin.weight.mul_(2)
        assert torch.allclose(lin(x), 2 * got - (lin.bias if with_bias else 0), atol=1e-4)
    with torch.inference_mode():
        frozen = nn.Linear(96, 40, bias=False)
        use_f32_kernel(frozen)
        assert torch.allclose(frozen(x), x @ frozen.weight.t(), atol=1e-4)


def test_f32_mm_takes_any_activation_layout_and_dtype(kernel_isa):  # noqa: F811
    torch.manual_seed(0)
    w = torch.randn(24, 64)
    x = torch.randn(64, 6).t()  # not contiguous
    assert torch.allclose(kernels.f32_mm(x, w), x @ w.t(), atol=1e-5)
    xb = torch.randn(3, 64).bfloat16()
    assert torch.allclose(kernels.f32_mm(xb, w), xb.float() @ w.t(), atol=1e-5)
    with pytest.raises(RuntimeError, match="contiguous fp32"):
        kernels.f32_mm(torch.randn(2, 64), w.t().contiguous().t())


def test_use_f32_kernel_swaps_plain_fp32_linears_in_place(kernel_isa, mode, tiny_dirs):  # noqa: F811
    mode("auto")
    model, _ = load_model(tiny_dirs["llama"])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(0, model.config.vocab_size, (2, 5))
    ref = model(ids)
    n_linear = sum(type(m) is nn.Linear for m in model.modules())
    assert use_f32_kernel(model) == n_linear > 0
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert all(isinstance(m, F32Linear) for m in model.modules() if isinstance(m, nn.Linear))
    assert model.state_dict().keys() == before.keys()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.embed_tokens.weight
    got = model(ids)  # rows = 2 x 5 = 10 tokens per linear: our tiles
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4)
    assert use_f32_kernel(model) == 0  # nothing plain left


def test_aten_mode_leaves_the_model_alone(kernel_isa, mode):  # noqa: F811
    mode("aten")
    model = nn.Sequential(nn.Linear(8, 4))
    assert use_f32_kernel(model) == 0 and type(model[0]) is nn.Linear



def test_autograd_keeps_torchs_linear(kernel_isa, mode):  # noqa: F811
    mode("auto")
    lin = nn.Linear(16, 8)
    use_f32_kernel(lin)
    x = torch.randn(3, 16, requires_grad=True)
    lin(x).sum().backward()  # f32_mm has no backward: F.linear takes it
    assert x.grad is not None and lin.weight.grad is not None


@pytest.mark.parametrize("extra_rows", [1, 31, 200])
@pytest.mark.parametrize("with_bias", [False, True])
def test_rows_above_the_limit_run_on_onednn(kernel_isa, mode, no_panels, extra_rows, with_bias):  # noqa: F811
    mode("auto")
    if onednn_min_rows() is None:
        pytest.skip("this torch has no oneDNN")
    torch.manual_seed(extra_rows)
    lin = nn.Linear(96, 40, bias=with_bias).requires_grad_(False)
    use_f32_kernel(lin)
    x = torch.randn(onednn_min_rows() + extra_rows, 96)
    ref = x.double() @ lin.weight.double().t() + (lin.bias.double() if with_bias else 0)
    got = lin(x)
    assert lin in f32._PREPARED and list(lin.state_dict()) == (["weight", "bias"] if with_bias else ["weight"])
    copied = copy.deepcopy(lin)  # the opaque copy stays outside the module: deepcopy and torch.save work
    torch.save(lin, io.BytesIO())
    assert torch.equal(copied(x), got)
    bound = 1e-5 * (x.double().abs() @ lin.weight.double().abs().t()).max().item() + 1e-6
    assert (got.double() - ref).abs().max().item() < bound
    small = x[: onednn_min_rows()]  # at the limit: our tiles, the same products
    assert torch.allclose(lin(small), got[: onednn_min_rows()], atol=1e-5)


def test_onednn_weight_follows_in_place_changes(kernel_isa, mode, no_panels):  # noqa: F811
    mode("auto")
    if onednn_min_rows() is None:
        pytest.skip("this torch has no oneDNN")
    lin = nn.Linear(64, 32, bias=False)
    use_f32_kernel(lin)
    x = torch.randn(onednn_min_rows() + 8, 64)
    with torch.no_grad():
        first = lin(x)
        lin.weight.mul_(2)  # what load_state_dict's copy_ does too: the weight's version moves
        assert torch.allclose(lin(x), 2 * first, atol=1e-5)
        lin.load_state_dict({"weight": torch.zeros(32, 64)})
        assert lin(x).abs().max() == 0



def test_a_linear_made_under_inference_mode_runs_on_onednn(kernel_isa, mode, no_panels):  # noqa: F811
    """Its weight is an inference tensor, which has no version counter (reading one raised)."""
    mode("auto")
    if onednn_min_rows() is None:
        pytest.skip("this torch has no oneDNN")
    with torch.inference_mode():
        lin = nn.Linear(64, 32, bias=False)
        use_f32_kernel(lin)
        x = torch.randn(onednn_min_rows() + 8, 64)
        got = lin(x)
    assert lin.weight.is_inference() and lin in f32._PREPARED
    assert torch.allclose(got, x @ lin.weight.t(), atol=1e-5)

@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("shape", [(1, 2 * 8), (5, 2 * 13), (2, 3, 2 * 64), (300, 2 * 40)])
def test_gated_act_equals_torch(kernel_isa, act, shape):  # noqa: F811
    torch.manual_seed(len(shape) + shape[-1])
    gu = 4 * torch.randn(*shape)
    gate, up = gu.split(shape[-1] // 2, dim=-1)
    ref = ACTIVATIONS[act](gate.double()) * up.double()
    got = kernels.gated_act(gu, act)
    assert got.shape == ref.shape
    assert torch.allclose(got.double(), ref, atol=2e-6, rtol=2e-6), (got.double() - ref).abs().max()
    assert torch.equal(kernels.gated_act(gu.mT.contiguous().mT, act), got)  # any layout in
    with pytest.raises(RuntimeError, match="fp32"):
        torch.ops.firstlight.gated_act(gu[..., :-1], 0)  # an odd width


@pytest.mark.parametrize("norm_cls", [RMSNorm, GemmaRMSNorm])
@pytest.mark.parametrize("shape", [(1, 8), (3, 7, 40), (300, 576), (2, 5, 3, 64)])
def test_rms_norm_equals_the_module(kernel_isa, norm_cls, shape):  # noqa: F811
    torch.manual_seed(shape[-1] + len(shape))
    norm = norm_cls(shape[-1], 1e-6).requires_grad_(False)
    norm.weight.normal_()
    x = 3 * torch.randn(*shape)
    ref = norm.double()(x.double())
    w = norm.weight.float() + (1.0 if norm_cls is GemmaRMSNorm else 0.0)
    got = kernels.rms_norm(x, w, 1e-6)
    assert got.shape == x.shape and torch.allclose(got.double(), ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(kernels.rms_norm(x.mT.contiguous().mT, w, 1e-6), got)  # any layout in
    with pytest.raises(RuntimeError, match="rms_norm"):
        kernels.rms_norm(x, w[:-1], 1e-6)


@pytest.mark.parametrize("rot", [64, 32])  # full and partial rotary (dims past Dr pass through)
@pytest.mark.parametrize("cos_batch", [3, 1])  # per-row tables, or one broadcast over the rows
def test_rope_equals_apply_rope_and_keeps_the_projection_layout(kernel_isa, rot, cos_batch):  # noqa: F811
    torch.manual_seed(rot + cos_batch)
    b, s, h, d = 3, 11, 5, 64
    qkv = torch.randn(b, s, (h + 2) * d)
    x = qkv[..., : h * d].reshape(b, s, h, d).transpose(1, 2)  # a view of the projection, as Attention's q
    positions = torch.arange(s).expand(cos_batch, s) + 7 * torch.arange(cos_batch)[:, None]
    cos, sin = rope_cos_sin(1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot)), positions, torch.float32)
    got = kernels.rope(x, cos, sin)
    ref = apply_rope(x.double(), cos.double(), sin.double())
    assert got.shape == x.shape and torch.allclose(got.double(), ref, atol=1e-6)
    assert got.permute(0, 2, 1, 3).is_contiguous()  # laid out [B, S, H, D]: k's [B * S, Hkv, D] stays a view
    assert torch.equal(kernels.rope(x.contiguous(), cos, sin), got)
    with pytest.raises(RuntimeError, match="rope"):
        kernels.rope(x, cos[..., :-1], sin[..., :-1])  # an odd rotary width


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_the_norms_and_rope_run_on_the_kernels_without_autograd(kernel_isa, mode, tmp_path, monkeypatch,  # noqa: F811
                                                                family):
    mode("auto")
    model, _ = load_model(write_tiny_checkpoint(tmp_path / family, family=family, seed=0))
    ids = torch.randint(0, model.config.vocab_size, (2, 40))
    ref = model(ids)
    use_f32_kernel(model)
    kinds = {type(m) for m in model.modules()}
    assert {FusedGemmaRMSNorm if family == "gemma3_text" else FusedRMSNorm, KernelAttention} <= kinds
    assert not kinds & {RMSNorm, GemmaRMSNorm, Attention}
    calls = []
    for op in ("rms_norm", "rope"):
        def spy(*args, real=getattr(kernels, op), op=op):  # noqa: ANN002, ANN202
            calls.append(op)
            return real(*args)
        monkeypatch.setattr(kernels, op, spy)
    with torch.inference_mode():
        got = model(ids)
    assert {"rms_norm", "rope"} <= set(calls)
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4)
    calls.clear()
    model.requires_grad_(True)  # autograd records: the modules' own forward (the kernels have no backward)
    assert torch.allclose(model(ids), ref, atol=1e-4, rtol=1e-4) and not calls


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_gated_mlps_take_the_fused_activation(kernel_isa, mode, tmp_path, family):  # noqa: F811
    mode("auto")
    model, _ = load_model(write_tiny_checkpoint(tmp_path / family, family=family, seed=0))
    ids = torch.randint(0, model.config.vocab_size, (2, 40))
    ref = model(ids)
    use_f32_kernel(model)
    mlps = [m for m in model.modules() if isinstance(m, GatedMLP)]
    assert mlps and all(type(m) is FusedGatedMLP for m in mlps)
    assert torch.allclose(model(ids), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fmt", ["int4", "w4a8"])
def test_the_engine_loader_fuses_quantized_models_too(kernel_isa, mode, tmp_path, fmt):  # noqa: F811
    """engine/llm.py `load`: quantization first, then the fp32 swaps; a GatedMLP over quantized linears takes the
    fused activation as well (it acts on their fp32 output)."""
    from firstlight.engine.llm import load

    mode("auto")
    path = write_tiny_checkpoint(tmp_path / "m", family="llama", seed=0)
    model, _ = load(path, quantization=fmt)
    mlps = [m for m in model.modules() if isinstance(m, GatedMLP)]
    assert mlps and all(type(m) is FusedGatedMLP for m in mlps)
    ids = torch.randint(0, model.config.vocab_size, (2, 24))
    got = model(ids)
    for m in mlps:
        m.__class__ = GatedMLP
    assert torch.allclose(got, model(ids), atol=1e-4, rtol=1e-4)


def test_a_failing_onednn_falls_back_to_our_tiles_and_the_blas(kernel_isa, mode, no_panels, monkeypatch):  # noqa: F811
    mode("auto")
    if onednn_min_rows() is None:
        pytest.skip("this torch has no oneDNN")

    def broken(*args):  # noqa: ANN002, ANN202
        raise RuntimeError("no primitive for this shape")

    monkeypatch.setattr(f32, "onednn_linear", broken)
    monkeypatch.setitem(f32._state, "onednn", onednn_min_rows())
    lin = nn.Linear(64, 32).requires_grad_(False)
    use_f32_kernel(lin)
    x = torch.randn(onednn_min_rows() + 40, 64)
    with pytest.warns(UserWarning, match="oneDNN fp32 matmul unavailable"):
        got = lin(x)
    assert torch.allclose(got, torch.nn.functional.linear(x, lin.weight, lin.bias), atol=1e-5)
    assert onednn_min_rows() is None  # given up for the process (the next call does not try again)
