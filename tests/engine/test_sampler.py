from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from firstlight import kernels
from firstlight.engine.detokenizer import IncrementalDetokenizer
from firstlight.engine.request import Request, SamplingParams
from firstlight.engine.sampler import (
    TOP_P_CANDIDATES,
    Sampler,
    apply_penalties,
    filter_logits,
    filter_rows,
    inverse_cdf,
)

from ..quant.test_int4_kernel import kernel_isa  # noqa: F401 - fixture

V = 50


def req(rid: str = "r", prompt=(1, 2, 3), out=(), eos=(2,), **kw) -> Request:
    r = Request(rid, list(prompt), SamplingParams(**kw), eos_token_ids=eos)
    r.output_token_ids = list(out)
    return r


def logits(seed: int = 0, n: int = 1) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_params_validated() -> None:
    for bad in ({"temperature": -1}, {"top_p": 0}, {"max_tokens": 0}, {"min_p": 2}, {"stop": [""]},
                {"min_tokens": 5, "max_tokens": 2}, {"nonsense": 1}, {"logprobs": 21}):
        with pytest.raises(ValidationError):
            SamplingParams(**bad)
    assert SamplingParams(stop="x").stop == ("x",)


def test_greedy_is_argmax() -> None:
    x = logits(n=4)
    toks, lps = Sampler().sample(x, [req(str(i), temperature=0.0) for i in range(4)])
    assert toks == x.argmax(-1).tolist() and lps == [None] * 4


def test_top_k_1_and_tiny_top_p_are_greedy() -> None:
    x = logits(1)
    s = Sampler()
    for _ in range(5):
        assert s.sample(x, [req(top_k=1)])[0] == [int(x.argmax())]
        assert s.sample(x, [req(top_p=1e-6)])[0] == [int(x.argmax())]
        assert s.sample(x, [req(min_p=1.0)])[0] == [int(x.argmax())]


def test_filters_keep_the_right_set() -> None:
    x = logits(2)[0]
    kept = filter_logits(x, SamplingParams(top_k=5)).isfinite()
    assert set(kept.nonzero().flatten().tolist()) == set(x.topk(5).indices.tolist())
    p = x.softmax(-1)
    kept = filter_logits(x, SamplingParams(top_p=0.5)).isfinite()
    order = p.argsort(descending=True)
    mass_before = p[order].cumsum(0) - p[order]
    assert kept[order].tolist() == (mass_before < 0.5).tolist()
    kept = filter_logits(x, SamplingParams(min_p=0.1)).isfinite()
    assert kept.tolist() == (p >= 0.1 * p.max()).tolist()


def test_sampling_follows_distribution() -> None:
    x = torch.tensor([[0.0, 1.0, 2.0] + [-1e9] * (V - 3)])
    s = Sampler(seed=0)
    r = req(temperature=1.0)
    counts = torch.zeros(3)
    for _ in range(3000):
        counts[s.sample(x, [r])[0][0]] += 1
    expected = x[0, :3].softmax(-1) * 3000
    assert torch.allclose(counts, expected, atol=100)  # ~ 4 sigma


def test_seed_independent_of_companions() -> None:
    x = logits(3, n=3)
    a = Sampler()
    alone = [a.sample(x[1:2], [req("s", temperature=1.0, seed=42)])[0][0] for _ in range(10)]
    b = Sampler()
    rows = [req("o1", temperature=1.0), req("s", temperature=1.0, seed=42), req("o2", temperature=0.7)]
    mixed = [b.sample(x, rows)[0][1] for _ in range(10)]
    assert alone == mixed


def test_penalties() -> None:
    x = torch.tensor([2.0, -2.0, 1.0, 0.5] + [0.0] * (V - 4))
    r = req(prompt=(0,), out=(1, 2, 2), eos=(), repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    y = apply_penalties(x.clone(), r)
    assert y[0] == pytest.approx(1.0)  # prompt token, positive: divided
    assert y[1] == pytest.approx(-4.0 - 0.5 - 0.25)  # negative: multiplied, then presence + 1x frequency
    assert y[2] == pytest.approx(0.5 - 0.5 - 0.5)  # 2 occurrences
    assert y[3] == pytest.approx(0.5)  # unseen


def test_min_tokens_blocks_eos() -> None:
    x = torch.full((1, V), -5.0)
    x[0, 2] = 10.0  # eos is by far the best
    toks, _ = Sampler().sample(x, [req(temperature=0.0, min_tokens=3, max_tokens=5)])
    assert toks[0] != 2
    toks, _ = Sampler().sample(x, [req(temperature=0.0, min_tokens=3, max_tokens=5, out=(7, 7, 7))])
    assert toks[0] == 2


def test_logprobs_top_n() -> None:
    x = logits(4)
    toks, lps = Sampler().sample(x, [req(temperature=0.0, logprobs=3)])
    lp = x.log_softmax(-1)[0]
    assert lps[0].token_id == toks[0] and lps[0].rank == 1
    assert lps[0].logprob == pytest.approx(float(lp.max()))
    assert [t for t, _ in lps[0].top] == lp.topk(3).indices.tolist()


def test_incremental_detokenizer_multibyte(tiny) -> None:
    _, tok = tiny
    text = "héllo wörld 🙂 ünïcode — ok"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text) // 4
    d = IncrementalDetokenizer(tok, tok.encode("Q:", add_special_tokens=False))
    pieces = []
    for t in ids:
        d.add_tokens([t])
        piece = d.take_delta(False)
        assert "\ufffd" not in piece
        pieces.append(piece)
    assert "".join(pieces) + d.take_delta(True) == tok.decode(ids)


def test_stop_string_across_tokens(tiny) -> None:
    _, tok = tiny
    ids = tok.encode("The quick brown fox jumps", add_special_tokens=False)
    d = IncrementalDetokenizer(tok, [1], stop=("brown f",))
    sent = ""
    stop = None
    for t in ids:
        stop = d.add_tokens([t])
        sent += d.take_delta(stop is not None)
        if stop:
            break
    assert stop == "brown f" and sent == "The quick "


def _top_p_by_full_sort(x: torch.Tensor, top_p: float) -> torch.Tensor:
    p = x.softmax(-1)
    order = p.argsort(descending=True)
    keep = torch.zeros_like(x, dtype=torch.bool)
    keep[order] = (p[order].cumsum(0) - p[order]) < top_p
    return keep


# peaked rows (the nucleus in the top 64 or 1024) and flatter ones (past them: the full sort)
@pytest.mark.parametrize("scale", [8.0, 2.0, 1.0, 0.01])
def test_top_p_over_a_large_vocabulary_matches_the_full_sort(scale: float) -> None:
    torch.manual_seed(3)
    x = torch.randn(4 * TOP_P_CANDIDATES[-1]) * scale
    for top_p in (0.5, 0.9, 0.99):
        kept = filter_logits(x, SamplingParams(top_p=top_p)).isfinite()
        assert kept.tolist() == _top_p_by_full_sort(x, top_p).tolist()


def test_filters_of_a_batch_are_each_rows_own() -> None:
    """filter_rows over rows with different filters (top-k, top-p with the nucleus inside the candidates and past
    them, both, min-p, none) keeps in each row what that row's filters keep on their own."""
    torch.manual_seed(5)
    v = 4 * TOP_P_CANDIDATES[-1]
    x = torch.randn(6, v) * torch.tensor([[8.0], [0.01], [8.0], [3.0], [1.0], [0.01]])
    params = [SamplingParams(top_k=7, temperature=0.9), SamplingParams(top_p=0.9), SamplingParams(top_p=0.5),
              SamplingParams(top_k=40, top_p=0.8, temperature=1.2), SamplingParams(min_p=0.2),
              SamplingParams(temperature=0.5)]
    got = filter_rows(x, params)
    assert torch.equal(got[5], x[5] / 0.5)
    assert set(got[0].isfinite().nonzero().flatten().tolist()) == set(x[0].topk(7).indices.tolist())
    assert got[1].isfinite().tolist() == _top_p_by_full_sort(x[1], 0.9).tolist()  # past the 1,024 candidates
    assert got[2].isfinite().tolist() == _top_p_by_full_sort(x[2], 0.5).tolist()
    top40 = (x[3] / 1.2).masked_fill(x[3] < x[3].topk(40).values[-1], float("-inf"))
    assert got[3].isfinite().tolist() == _top_p_by_full_sort(top40, 0.8).tolist()
    p = x[4].softmax(-1)
    assert got[4].isfinite().tolist() == (p >= 0.2 * p.max()).tolist()
    for i in range(6):  # kept logits keep their (tempered) values; one row alone filters the same
        assert torch.equal(got[i], filter_logits(x[i], params[i]))


@pytest.mark.parametrize("v", [768, 700])  # three blocks of 256; not a multiple of 256: one block
def test_inverse_cdf_is_a_categorical_draw(v: int) -> None:
    torch.manual_seed(0)
    w = torch.rand(2, v) ** 4
    w[:, ::3] = 0.0  # zero weights: never drawn
    w[1, 300:] = 0.0  # a row whose mass ends early (last blocks all zero)
    u = torch.rand(20000, dtype=torch.float64)
    for row in range(2):
        picks = inverse_cdf(w[row].expand(len(u), v).contiguous(), u)
        assert (w[row, picks] > 0).all()
        counts = torch.bincount(picks, minlength=v).double()
        expected = w[row].double() / w[row].double().sum() * len(u)
        assert ((counts - expected).abs() <= 5 * expected.sqrt() + 3).all()  # ~5 sigma per token
    # u at the top of [0, 1): the last token with weight, not a zero one after it
    last = inverse_cdf(w, torch.full((2,), 1.0 - 2**-53, dtype=torch.float64))
    assert last.tolist() == [int(w[r].nonzero().max()) for r in range(2)]


@pytest.mark.parametrize("v", [768, 700, 5])  # three blocks of 256; a partial last block; fewer than a vector
def test_the_kernel_draw_is_the_inverse_cdf_draw(kernel_isa, v: int) -> None:  # noqa: F811
    """firstlight::sample_rows on logits draws what inverse_cdf draws on exp(logits / T - max): the same token for
    the same u (up to the two exps' last bit at a boundary), -inf logits never, a row's last token with weight
    at u -> 1."""
    torch.manual_seed(0)
    w = torch.rand(3, v) ** 4
    w[:, ::3] = 0.0
    w[1, min(300, v - 1):] = 0.0  # a row whose mass ends early
    logits = w.log()  # zero weight: -inf
    u = torch.rand(4000, dtype=torch.float64)
    for row, temp in ((0, 1.0), (1, 1.0), (2, 0.7)):
        idx = torch.full((len(u),), row)
        got = kernels.sample_rows(logits, idx, torch.full((len(u),), 1 / temp), u)
        e = (logits[row] / temp - (logits[row] / temp).max()).exp()
        ref = inverse_cdf(e.expand(len(u), v).contiguous(), u)
        assert (w[row, got] > 0).all()
        assert (got == ref).float().mean() > 0.995 and (got - ref).abs().max() <= 3
    last = kernels.sample_rows(logits, torch.arange(3), torch.ones(3), torch.full((3,), 1.0 - 2**-53, dtype=torch.float64))
    assert last.tolist() == [int(w[r].nonzero().max()) for r in range(3)]


def test_the_kernel_draw_rejects_bad_rows(kernel_isa) -> None:  # noqa: F811
    x = torch.randn(2, 10)
    with pytest.raises(RuntimeError, match="out of"):
        kernels.sample_rows(x, torch.tensor([2]), torch.ones(1), torch.rand(1, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="u fp64"):
        kernels.sample_rows(x, torch.tensor([0]), torch.ones(1), torch.rand(1))


def test_sampling_the_same_with_and_without_the_kernel(kernel_isa, monkeypatch) -> None:  # noqa: F811
    """Seeded rows (temperature, top-k, top-p, min-p, greedy) draw the same tokens on either path."""
    x = torch.randn(5, 3000, generator=torch.Generator().manual_seed(4)) * 4
    params = [dict(temperature=0.8), dict(temperature=1.3, top_k=50), dict(temperature=1.0, top_p=0.9),
              dict(temperature=0.6, min_p=0.05), dict(temperature=0.0)]
    rows = [req(f"r{i}", seed=7 + i, **p) for i, p in enumerate(params)]
    draws = {}
    for mode in ("firstlight", "aten"):
        monkeypatch.setenv(kernels.ENV, mode)
        s = Sampler()
        draws[mode] = [s.sample(x, rows)[0] for _ in range(40)]
    pairs = zip(draws["firstlight"], draws["aten"], strict=True)
    same = sum(a == b for da, db in pairs for a, b in zip(da, db, strict=True))
    assert same >= 0.99 * 40 * len(rows)


@pytest.mark.parametrize("v", [1, 7, 16, 17, 40, 49152])
def test_the_kernel_argmax_is_torchs(kernel_isa, v: int) -> None:  # noqa: F811
    """firstlight::argmax_rows == torch.argmax(-1): the first of tied maxima (in any lane, in the tail), the first
    NaN of a row, an all -inf row, rows of a wider tensor (row stride > V)."""
    torch.manual_seed(v)
    x = torch.randn(6, v)
    x[1] = torch.randint(0, 3, (v,)).float()  # many ties at the maximum
    x[2] = float("-inf")
    x[3, v // 2] = float("nan")
    x[3, -1] = float("nan")
    x[4, -1] = 100.0  # the maximum in the tail
    x[5] = x[5].round()
    assert torch.equal(kernels.argmax_rows(x), x.argmax(-1))
    wide = torch.randn(4, v + 5)
    assert torch.equal(kernels.argmax_rows(wide[:, :v]), wide[:, :v].argmax(-1))
    with pytest.raises(RuntimeError, match="contiguous rows"):
        kernels.argmax_rows(torch.randn(v, 6).t())
