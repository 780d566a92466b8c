"""GPTQ over each format's grid, the calibrated model path and its cache, the calibration text
(never the evaluation text), and the int8 head that int4/fp8 keep when it is tied to the embedding."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from firstlight.models.loader import load_model
from firstlight.quant import QuantizationError, quantize_model
from firstlight.quant.calibrated import calibration_text, calibration_token_ids
from firstlight.quant.fp8 import FP8Grid
from firstlight.quant.gptq import collect_hessians, gptq_quantize, output_error
from firstlight.quant.int4 import Int4GroupGrid
from firstlight.quant.int8 import Int8ChannelGrid, Int8WeightOnlyLinear

GRIDS = {
    "int8": lambda: Int8ChannelGrid(torch.bfloat16),
    "fp8": lambda: FP8Grid(),
    "fp8-block32": lambda: FP8Grid(group_size=32),
    "int4": lambda: Int4GroupGrid(32, torch.bfloat16),
    "w8a8": lambda: Int8ChannelGrid(torch.float32, qmax=63),
}


def _rtn(grid, w: torch.Tensor) -> torch.Tensor:
    if grid.group_size is None:
        return grid.round(w, grid.fit(w))
    g = grid.group_size
    return torch.cat([grid.round(w[:, i : i + g], grid.fit(w[:, i : i + g])) for i in range(0, w.shape[1], g)], 1)


def _problem(seed: int = 0, n: int = 48, k: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # correlated inputs with a few large channels, like a transformer's: GPTQ has something to use
    x = torch.randn(2048, k, generator=gen) @ torch.randn(k, k, generator=gen) * 0.3
    x[:, :4] *= 8
    return torch.randn(n, k, generator=gen) * 0.05, x.t() @ x / x.shape[0]


@pytest.mark.parametrize("name", list(GRIDS))
def test_gptq_lowers_output_error_and_stays_on_the_grid(name):
    grid = GRIDS[name]()
    w, h = _problem()
    res = gptq_quantize(w, h, grid)
    assert res.weight.shape == w.shape
    # every value is a grid point under the returned parameters
    if grid.group_size is None:
        assert res.params[0].shape == (w.shape[0],)
        assert torch.equal(grid.round(res.weight, res.params), res.weight)
    else:
        g = grid.group_size
        assert res.params[0].shape == (w.shape[0], w.shape[1] // g)
        for j in range(w.shape[1] // g):
            cols = res.weight[:, j * g : (j + 1) * g]
            assert torch.equal(grid.round(cols, tuple(p[:, j] for p in res.params)), cols)
    # the objective GPTQ minimizes, tr((Q - W) H (Q - W)^T), is well below round-to-nearest's
    assert output_error(w, res.weight, h) < 0.8 * output_error(w, _rtn(grid, w), h)


def test_gptq_dead_inputs_and_identity_hessian():
    w, h = _problem(1)
    h[5, :] = 0
    h[:, 5] = 0  # input 5 is always zero
    res = gptq_quantize(w, h, Int8ChannelGrid())
    assert bool(torch.isfinite(res.weight).all()) and bool((res.weight[:, 5] == 0).all())
    # with uncorrelated unit inputs there is nothing to compensate: GPTQ = round-to-nearest
    grid = Int8ChannelGrid()
    res = gptq_quantize(w, torch.eye(w.shape[1]), grid, act_order=False, damp=0.0)
    assert torch.equal(res.weight, _rtn(grid, w))


def test_collect_hessians_is_mean_outer_product():
    lin = nn.Sequential(nn.Linear(8, 4))
    seen = []
    lin[0].register_forward_pre_hook(lambda _m, a: seen.append(a[0].reshape(-1, 8)))

    class Wrap(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.body = nn.Embedding(10, 8), lin

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.body(self.emb(ids))

    model = Wrap()
    h = collect_hessians(model, list(range(10)) * 3, ["body.0"], seq_len=7)["body.0"]
    x = torch.cat(seen)
    assert x.shape[0] == 30
    torch.testing.assert_close(h, x.t() @ x / 30)


def _ids(n: int = 96) -> list[int]:
    return [(7 * i + 3) % 50 + 1 for i in range(n)]


@pytest.mark.parametrize("fmt", ["int4", "w4a8", "w8a8"])  # w4a8: its GPTQ cache holds the tiled layout's buffers
def test_gptq_model_is_closer_than_rtn_and_cache_round_trips(tiny_dirs, tmp_path, fmt):
    ref, _ = load_model(tiny_dirs["llama"], with_tokenizer=False)
    ids = torch.tensor([_ids()])
    with torch.no_grad():
        y_ref = ref(ids)
    errs, outs = {}, {}
    for run, method in (("rtn", "rtn"), ("gptq", "gptq"), ("cached", "gptq")):
        model, _ = load_model(tiny_dirs["llama"], with_tokenizer=False)
        report = quantize_model(model, fmt, method=method, calibration_ids=_ids() if method == "gptq" else None,
                                calibration_name="test", cache_dir=tmp_path)
        assert report.method == method
        with torch.no_grad():
            outs[run] = model(ids)
        errs[run] = (outs[run] - y_ref).pow(2).mean().item()
        if run == "cached":
            assert "cached" in report.calibration
        elif run == "gptq":
            assert "GPTQ" in report.calibration and len(list(tmp_path.glob(f"gptq-{fmt}-*.safetensors"))) == 1
    assert errs["gptq"] < errs["rtn"]
    torch.testing.assert_close(outs["cached"], outs["gptq"], rtol=0, atol=0)


def test_gptq_needs_ids_and_methods_are_checked(tiny_dirs):
    model, _ = load_model(tiny_dirs["llama"], with_tokenizer=False)
    with pytest.raises(QuantizationError, match="calibration"):
        quantize_model(model, "int8", method="gptq")
    with pytest.raises(QuantizationError, match="method"):
        quantize_model(model, "int8", method="awq")
    with pytest.raises(QuantizationError, match="lm_head"):
        quantize_model(model, "int8", lm_head="int2")


@pytest.mark.parametrize("fmt", ["int4", "fp8"])
def test_tied_head_is_int8_shared_with_embedding_by_default(tiny_dirs, fmt):
    auto, _ = load_model(tiny_dirs["qwen2"], with_tokenizer=False)
    same, _ = load_model(tiny_dirs["qwen2"], with_tokenizer=False)
    r_auto = quantize_model(auto, fmt)
    r_same = quantize_model(same, fmt, lm_head="same")
    assert isinstance(auto.lm_head, Int8WeightOnlyLinear)
    assert auto.lm_head.qweight.data_ptr() == auto.embed_tokens.qweight.data_ptr()
    assert not isinstance(same.lm_head, Int8WeightOnlyLinear)
    assert r_auto.weight_bytes_after < r_same.weight_bytes_after  # one int8 table instead of two copies


def test_calibration_text_drops_every_part_sharing_a_line_with_the_eval_text(tmp_path):
    from firstlight.data import load_text

    hamlet_line = next(ln.strip() for ln in load_text("hamlet-sample").splitlines() if len(ln.strip()) >= 40)
    corpus = tmp_path / "plays.txt"
    corpus.write_text(
        "THE FIRST PLAY\n\nby William Shakespeare\n\nA line of the first play that is long enough.\n"
        f"THE SECOND PLAY\n\nby William Shakespeare\n\n{hamlet_line}\nmore of the second play\n"
        "THE THIRD PLAY\n\nby William Shakespeare\n\nThe third play, all new words in it.\n"
    )
    text = calibration_text(str(corpus))
    assert "FIRST PLAY" in text and "THIRD PLAY" in text
    assert "SECOND PLAY" not in text and hamlet_line not in text

    class Chars:
        def encode(self, s: str) -> list[int]:
            return [ord(c) for c in s]

    ids = calibration_token_ids(Chars(), str(corpus), num_tokens=64)
    assert 16 <= len(ids) <= 64
    only_hamlet = tmp_path / "hamlet.txt"
    only_hamlet.write_text(f"{hamlet_line}\n")
    with pytest.raises(QuantizationError, match="overlap"):
        calibration_text(str(only_hamlet))
