"""firstlight's int4 CPU kernel (firstlight::int4_mm): equal to x @ W~^T in fp32 for any M and N, the same
W~ as quantize/dequantize_groupwise_int4, one opaque op under torch.compile(fullgraph=True), and the
aten fallback when it is forced or cannot be built."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
from torch import nn

from firstlight import kernels
from firstlight.quant import QuantizationError, get_format
from firstlight.quant.int4 import dequantize_groupwise_int4, quantize_groupwise_int4


@pytest.fixture(scope="session")
def kernel_isa() -> str:
    """Build (or reuse: it is compiled once per machine under $FIRSTLIGHT_HOME/kernels) our kernel."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler on PATH: firstlight's int4 kernel cannot be built (aten is used)")
    if shutil.which("ninja") is None:
        try:
            import ninja  # noqa: F401
        except ImportError:
            pytest.skip("no ninja: torch.utils.cpp_extension cannot build firstlight's int4 kernel (aten is used)")
    kernels.reset_for_tests()
    isa = kernels.load_kernel()
    if isa is None:
        pytest.skip(f"firstlight's int4 kernel did not build: {kernels._state.get('error')}")
    return isa


@pytest.fixture()
def mode(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    def set_mode(value: str) -> None:
        monkeypatch.setenv(kernels.ENV, value)
        kernels.reset_for_tests()
    yield set_mode
    kernels.reset_for_tests()


def _case(n: int, k: int, g: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(seed)
    w = torch.randn(n, k) / k**0.5
    w[0, 0] = 3.0  # an outlier group
    return quantize_groupwise_int4(w, g, param_dtype=torch.bfloat16)


# K = 2112 / 4096: the M >= 6 panel path splits K in 2 / 3 chunks of whole groups (the last one shorter)
@pytest.mark.parametrize("n,k,g", [(64, 128, 32), (40, 96, 32), (19, 256, 64), (7, 256, 128), (24, 512, 256),
                                   (50, 2112, 64), (29, 4096, 256)])
# 2..5: per-row register tiles; 6..: the panel, M split in tiles of 3-4 rows (6 = 3 + 3, 7 = 4 + 3,
# 9 = 3 + 3 + 3, 10 = 4 + 3 + 3, 11 = 4 + 4 + 3); 140 > MAX_TILED_M: dequantize + mm
@pytest.mark.parametrize("m", [1, 2, 3, 5, 6, 7, 8, 9, 10, 11, 17, 64, 140])
def test_int4_mm_equals_fp32_dequantized_matmul(kernel_isa, m, n, k, g):
    q, scale, zero = _case(n, k, g)
    packed, d, mins = kernels.pack_int4(q, scale, zero, g)
    w_ref = dequantize_groupwise_int4(q, scale, zero, g)
    # the kernel's weight (fma(q, d, m)) is the format's W~ up to one fp32 rounding
    assert torch.allclose(kernels.int4_dequant(packed, d, mins, g), w_ref, rtol=0, atol=1e-6)
    x = torch.randn(m, k)
    ref = (x.double() @ w_ref.double().t()).float()
    y = kernels.int4_mm(x, packed, d, mins, g)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    # fp32 accumulation: far tighter than the bf16 activations of the aten kernel (~4e-3 relative)
    assert torch.allclose(y, ref, rtol=0, atol=1e-5 * ref.abs().max().item() + 1e-6)


@pytest.mark.parametrize("n", [48, 9000])  # 9000 rows of K=128: dequantized in two slabs
def test_int4_mm_large_m_dequantize_path_matches(kernel_isa, n):
    q, scale, zero = _case(n, 128, 32)
    packed, d, mins = kernels.pack_int4(q, scale, zero, 32)
    x = torch.randn(kernels.MAX_TILED_M + 3, 128)
    y = kernels.int4_mm(x, packed, d, mins, 32)
    tiled = torch.cat([kernels.int4_mm(x[i:i + 8], packed, d, mins, 32) for i in range(0, len(x), 8)])
    assert torch.allclose(y, tiled, rtol=1e-5, atol=1e-5)


def test_the_library_runs_on_torchs_threads(kernel_isa):
    """Built with OpenMP: an at::parallel_for of ours runs on torch.set_num_threads threads. Without -fopenmp
    the header-inlined parallel_for runs serially: every kernel of ours ran on one core whatever the setting."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.ops.firstlight.parallel_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_int4_mm_rejects_bad_shapes(kernel_isa):
    q, scale, zero = _case(16, 64, 32)
    packed, d, mins = kernels.pack_int4(q, scale, zero, 32)
    with pytest.raises(RuntimeError, match="must be"):
        kernels.int4_mm(torch.randn(2, 32), packed, d, mins, 32)
    with pytest.raises(QuantizationError, match="multiples of 32"):
        kernels.pack_int4(q[:, :48], scale, zero, 48)


def test_linear_uses_our_kernel_and_matches_reference(kernel_isa, mode):
    mode("auto")
    torch.manual_seed(1)
    lin = nn.Linear(96, 40, bias=True).requires_grad_(False)  # N = 40: not a multiple of 16, allowed here
    fmt = get_format("int4", group_size=32)
    assert fmt.kernel_path(torch.device("cpu"), torch.float32).startswith(f"firstlight::int4_mm ({kernel_isa}")
    ql = fmt.quantize_linear(lin)
    assert ql.ours and "firstlight::int4_mm" in ql.kernel
    q, scale, zero = quantize_groupwise_int4(lin.weight, 32, param_dtype=torch.bfloat16)
    w_ref = dequantize_groupwise_int4(q, scale, zero, 32)
    assert torch.allclose(ql.dequantized_weight(), w_ref, atol=1e-6, rtol=0)
    x = torch.randn(2, 3, 96)
    ref = x @ w_ref.t() + lin.bias
    assert torch.allclose(ql(x), ref, atol=1e-5, rtol=1e-5)
    assert torch.allclose(ql(x.bfloat16()).float(), ref, atol=3e-2, rtol=3e-2)  # dtype in = dtype out


def test_forced_aten_fallback(mode):
    mode("aten")
    torch.manual_seed(2)
    lin = nn.Linear(64, 32, bias=False).requires_grad_(False)
    fmt = get_format("int4", group_size=32)
    assert fmt.kernel_path(torch.device("cpu"), torch.float32).startswith("aten._weight_int4pack_mm_for_cpu")
    ql = fmt.quantize_linear(lin)
    assert not ql.ours and hasattr(ql, "scales_and_zeros")
    x = torch.randn(3, 64)
    assert torch.allclose(ql(x), x.bfloat16().float() @ ql.dequantized_weight().t(), atol=3e-2, rtol=3e-2)
    with pytest.raises(QuantizationError, match="multiple of 16"):
        fmt.quantize_linear(nn.Linear(64, 40))


def test_the_switch_keeps_its_earlier_name(monkeypatch):
    monkeypatch.delenv(kernels.ENV, raising=False)
    monkeypatch.setenv(kernels.OLD_ENV, "aten")
    assert kernels.kernel_mode() == "aten"
    monkeypatch.setenv(kernels.ENV, "auto")  # the current name wins
    assert kernels.kernel_mode() == "auto"


def test_build_failure_falls_back_with_one_warning_or_raises_when_required(mode, monkeypatch):
    def broken() -> str:
        raise OSError("no compiler here\nsecond line")
    monkeypatch.setattr(kernels, "_build", broken)
    mode("auto")
    with pytest.warns(RuntimeWarning, match="did not build .*OSError: no compiler here.*aten") as rec:
        assert kernels.load_kernel() is None
        assert kernels.load_kernel() is None  # warned once, remembered
    assert len(rec) == 1
    ql = get_format("int4", group_size=32).quantize_linear(nn.Linear(64, 32))
    assert not ql.ours
    mode("firstlight")
    with pytest.raises(QuantizationError, match="could not be built: OSError: no compiler here"):
        kernels.load_kernel()
    mode("bogus")
    with pytest.raises(QuantizationError, match="FIRSTLIGHT_CPU_KERNELS"):
        kernels.load_kernel()


@pytest.mark.parametrize("fmt, op", [("int4", "firstlight.int4_mm"), ("int8", "firstlight.int8_mm"),
                                     ("w4a8", "firstlight.int4_mm_a8"), ("fp32", "firstlight.f32_mm")])
def test_each_custom_op_is_one_node_under_compile_fullgraph(kernel_isa, mode, fmt, op):
    from firstlight.quant.f32 import use_f32_kernel

    mode("auto")
    torch.manual_seed(3)
    if fmt == "fp32":  # not a format: a frozen plain linear (as loaded), routed through our fp32 kernel
        ql = nn.Linear(64, 48).requires_grad_(False)
        use_f32_kernel(ql)
    else:
        ql = get_format(fmt).quantize_linear(nn.Linear(64, 48))
    seen: list[str] = []

    def backend(gm: torch.fx.GraphModule, example_inputs):  # noqa: ANN001, ANN202
        seen.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    x = torch.randn(1, 64)
    compiled = torch.compile(ql, backend=backend, fullgraph=True)
    assert torch.allclose(compiled(x), ql(x))
    assert sum(s.endswith(op) or f"{op}." in s for s in seen) == 1, seen
    torch._dynamo.reset()


@pytest.mark.slow
def test_custom_op_under_inductor(kernel_isa, mode):
    mode("auto")
    torch.manual_seed(4)
    ql = get_format("int4", group_size=32).quantize_linear(nn.Linear(64, 48))
    torch._dynamo.reset()
    x = torch.randn(2, 64)
    out = torch.compile(ql, fullgraph=True)(x)  # inductor: the fake kernel gives it the output's shape
    assert torch.allclose(out, ql(x), atol=1e-6)
    torch._dynamo.reset()


SCALAR_CHECK = """
import torch
from firstlight import kernels as k
from firstlight.quant.int4 import dequantize_groupwise_int4, quantize_groupwise_int4
assert k.load_kernel() == "scalar"
torch.manual_seed(0)
for m, n, kk, g in [(1, 24, 128, 32), (5, 16, 256, 64), (20, 8, 64, 32)]:
    q, s, z = quantize_groupwise_int4(torch.randn(n, kk), g)
    p, d, mins = k.pack_int4(q, s, z, g)
    x = torch.randn(m, kk)
    ref = x.double() @ dequantize_groupwise_int4(q, s, z, g).double().t()
    err = (k.int4_mm(x, p, d, mins, g).double() - ref).abs().max().item()
    assert err < 1e-5 * ref.abs().max().item() + 1e-6, (m, n, kk, g, err)
    ref8 = k.quantize_act_int8(x).double() @ dequantize_groupwise_int4(q, s, z, g).double().t()
    err8 = (k.int4_mm_a8(x, p, d, mins, g).double() - ref8).abs().max().item()
    assert err8 < 1e-5 * ref8.abs().max().item() + 1e-6, (m, n, kk, g, err8)
    qi = torch.randint(-127, 128, (n, kk), dtype=torch.int8)
    sc = torch.rand(n) + 0.5
    for a8 in (False, True):
        xx = k.quantize_act_int8(x).double() if a8 else x.double()
        ref = xx @ (qi.double() * sc.double()[:, None]).t()
        err = (k.int8_mm(x, qi, sc, a8).double() - ref).abs().max().item()
        assert err < 1e-5 * ref.abs().max().item(), (m, n, kk, a8, err)
    if n % 16 == 0:  # the VNNI layout: its dequantization works anywhere, its matmul only where it was built
        vp, vd, vm = k.pack_int4_vnni(p, d, mins)
        assert torch.equal(k.int4_dequant(vp, vd, vm, g), k.int4_dequant(p, d, mins, g))
        try:
            k.int4_mm_a8(x, vp, vd, vm, g)
            raise AssertionError("the scalar library ran the VNNI layout")
        except RuntimeError as e:
            assert "VNNI layout given to a library built without" in str(e), e
    w32, b32 = torch.randn(n + 3, kk + 5), torch.randn(n + 3)
    x32 = torch.randn(m, kk + 5)
    ref = x32.double() @ w32.double().t() + b32.double()
    err = (k.f32_mm(x32, w32, b32).double() - ref).abs().max().item()
    assert err < 1e-5 * ref.abs().max().item(), (m, n, kk, err)
print("ok")
"""


@pytest.mark.slow
def test_scalar_fallback_path_builds_and_matches(kernel_isa, tmp_path):
    """The portable (non-AVX2) path, built cold into a scratch FIRSTLIGHT_HOME in a fresh process
    (one process can load only one library that defines the firstlight ops)."""
    env = {**os.environ, "FIRSTLIGHT_HOME": str(tmp_path), kernels.ISA_ENV: "scalar",
           kernels.ENV: "firstlight", "PYTHONPATH": os.getcwd()}
    res = subprocess.run([sys.executable, "-c", SCALAR_CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-2000:]


def test_isa_detection(monkeypatch):
    full = "processor : 0\nflags : fpu sse avx2 fma avx512f avx512dq avx512bw avx512vl avx512_vnni avx512_bf16\n"
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert kernels.cpu_has_avx512_vnni(full)
    assert not kernels.cpu_has_avx512_vnni(full.replace(" avx512_vnni", ""))  # AVX-512 without VNNI: avx2 build
    assert not kernels.cpu_has_avx512_vnni("processor : 0\n")  # no flags line
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert not kernels.cpu_has_avx512_vnni(full) and kernels.default_isa() == "avx2"
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    assert kernels.default_isa() == "scalar"


def test_unknown_isa_is_a_clear_error(mode, monkeypatch):
    monkeypatch.setenv(kernels.ISA_ENV, "avx9000")
    kernels.reset_for_tests()
    monkeypatch.setattr(kernels, "_loaded", [])
    with pytest.raises(QuantizationError, match="avx9000.*avx512vnni, avx2, scalar"):
        kernels._build()
