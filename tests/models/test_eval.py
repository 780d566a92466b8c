from __future__ import annotations

import math

import pytest
import torch

from firstlight.data import load_text
from firstlight.errors import FirstlightError
from firstlight.eval.ppl import mean_kl, perplexity, windows
from firstlight.models.loader import load_model


@pytest.mark.parametrize("n,window,stride", [(10, 4, 2), (100, 32, 31), (7, 16, 8), (33, 8, 3)])
def test_windows_score_every_token_once(n, window, stride):
    scored = [i for _, end, first in windows(n, window, stride) for i in range(first, end)]
    assert scored == list(range(1, n))


def test_uniform_model_has_vocab_perplexity():
    vocab = 50
    res = perplexity(lambda ids: torch.zeros(1, ids.shape[1], vocab), list(range(40)), window=16, stride=8)
    assert res.perplexity == pytest.approx(vocab, rel=1e-5) and res.num_tokens == 39


def test_ppl_matches_full_forward_nll(tiny_dirs):
    model, tok = load_model(tiny_dirs["llama"])
    ids = tok.encode(load_text("hamlet-sample")[:600])[:100]
    res = perplexity(model, ids, window=128, stride=64)
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0]
    nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:])).item()
    assert res.perplexity == pytest.approx(math.exp(nll), rel=1e-5)


def test_kl_zero_for_same_model_positive_otherwise(tiny_dirs):
    a, tok = load_model(tiny_dirs["llama"])
    b, _ = load_model(tiny_dirs["llama"], dtype="bfloat16")
    ids = tok.encode("To be, or not to be, that is the question.")
    assert mean_kl(a, a, ids) == pytest.approx(0.0, abs=1e-6)
    assert mean_kl(a, b, ids) > 0


def test_corpus_errors(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(FirstlightError, match="is empty"):
        load_text(str(empty))
    with pytest.raises(FirstlightError, match="neither a file nor one of"):
        load_text("no-such-corpus")
    assert "Elsinore" in load_text("hamlet-sample")
    assert "def " in load_text("python-stdlib")
