"""Proposers: n-gram lookup, draft (separate and self-speculative), heads; greedy output is unchanged."""

import pytest
import torch

from firstlight.engine.speculative.config import SpecConfig
from firstlight.engine.speculative.generate import SpecStats, speculative_generate
from firstlight.engine.speculative.heads import HeadsProposer
from firstlight.engine.speculative.medusa import MedusaHeads, load_heads, model_name, save_heads
from firstlight.engine.speculative.ngram import ngram_lookup
from firstlight.engine.speculative.registry import make_proposer, proposer_names
from firstlight.errors import FirstlightError
from firstlight.models.generate import generate_tokens

PROMPTS = [[1, 40, 41, 42, 43, 40, 41], [1, 7, 8, 9, 10, 11, 12, 13, 7, 8], [1, 100, 200, 50]]


def test_registry_names():
    assert proposer_names() == ["draft", "heads", "mtp", "ngram"]
    with pytest.raises(FirstlightError, match="unknown"):
        SpecConfig("medusa2")


def test_ngram_lookup_prefers_longest_and_latest_match():
    assert ngram_lookup([1, 2, 3, 9, 1, 2, 3, 8, 5, 1, 2, 3], 2) == [8, 5]  # latest "1 2 3" wins
    assert ngram_lookup([4, 5, 6, 7, 5], 3) == [6, 7, 5]
    assert ngram_lookup([1, 2, 3], 2) == []
    assert ngram_lookup([7, 7], 3, max_ngram=1) == [7]


def _plain(model, prompt, n, **kw):
    return list(generate_tokens(model, prompt, n, **kw))


def _spec(model, proposer, prompt, n, stats=None, **kw):
    return [t for chunk in speculative_generate(model, proposer, prompt, n, stats=stats, **kw) for t in chunk]


def _random_heads(model, seed=0, num_heads=4):
    heads = MedusaHeads(model.config.hidden_size, num_heads)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return heads


@pytest.mark.parametrize("method", ["none", "ngram", "draft-self", "draft-model", "heads"])
def test_greedy_output_identical_to_plain_decoding(tiny, tiny_dir, tmp_path, method):
    model, tok = tiny
    if method == "none":
        proposer = None
    elif method == "ngram":
        proposer = make_proposer(SpecConfig("ngram"), model, tok)
    elif method == "draft-self":
        proposer = make_proposer(SpecConfig("draft", draft_layers=2), model, tok)
    elif method == "draft-model":
        from firstlight.models.tiny import write_tiny_checkpoint

        d = write_tiny_checkpoint(tmp_path / "draft", "llama", seed=3, num_hidden_layers=1)
        proposer = make_proposer(SpecConfig("draft", draft_model=str(d)), model, tok)
    else:
        proposer = HeadsProposer(model, _random_heads(model))
    for prompt in PROMPTS:
        stats = SpecStats()
        got = _spec(model, proposer, prompt, 40, stats=stats, num_spec_tokens=3)
        assert got == _plain(model, prompt, 40)
        if proposer is not None:
            assert stats.num_steps < 40  # speculation actually ran
            assert stats.num_emitted == len(got) - 1


def test_self_draft_accepts_more_than_it_rejects_on_repetitive_output(tiny):
    """A sanity bound on acceptance: the n-gram proposer on a looping greedy output."""
    model, tok = tiny
    stats = SpecStats()
    _spec(model, make_proposer(SpecConfig("ngram"), model, tok), PROMPTS[0], 60, stats=stats, num_spec_tokens=4)
    assert stats.mean_tokens_per_step > 1.0


@pytest.mark.parametrize("method", ["ngram", "draft", "heads"])
def test_seeded_sampling_reproducible(tiny, method):
    model, tok = tiny
    if method == "heads":
        proposer = HeadsProposer(model, _random_heads(model))
    else:
        proposer = make_proposer(SpecConfig(method, draft_layers=2), model, tok)
    runs = [_spec(model, proposer, PROMPTS[1], 30, temperature=1.0, seed=11) for _ in range(2)]
    assert runs[0] == runs[1]
    other = _spec(model, proposer, PROMPTS[1], 30, temperature=1.0, seed=12)
    assert other != runs[0]


def test_draft_with_other_vocab_is_a_clear_error(tiny, tmp_path):
    from firstlight.models.tiny import write_tiny_checkpoint

    model, tok = tiny
    d = write_tiny_checkpoint(tmp_path / "draft", "llama", seed=3, vocab_size=320)
    with pytest.raises(FirstlightError, match="vocabulary of 320 tokens but the target has 384"):
        make_proposer(SpecConfig("draft", draft_model=str(d)), model, tok)


def test_self_draft_layers_out_of_range(tiny):
    model, tok = tiny
    with pytest.raises(FirstlightError, match="draft_layers must be in"):
        make_proposer(SpecConfig("draft", draft_layers=4), model, tok)


def test_heads_file_roundtrip_and_mismatch(tiny, tmp_path):
    from firstlight.models.loader import load_model
    from firstlight.models.tiny import write_tiny_checkpoint

    model, tok = tiny
    heads = _random_heads(model)
    path = save_heads(heads, tmp_path / "h.safetensors", model.config, model_name(model.config))
    loaded, meta = load_heads(path, model.config, "tiny")
    assert meta["num_heads"] == "4"
    assert all(torch.equal(a, b) for a, b in zip(heads.state_dict().values(), loaded.state_dict().values(), strict=True))
    other, _ = load_model(write_tiny_checkpoint(tmp_path / "other", "qwen2", seed=1))
    with pytest.raises(FirstlightError, match="was trained for model 'llama-4L-64d'.*but the target is"):
        load_heads(path, other.config, model_name(other.config))
    with pytest.raises(FirstlightError, match="fewer than num_spec_tokens"):
        make_proposer(SpecConfig("heads", num_spec_tokens=6, heads_path=str(path)), model, tok)
    with pytest.raises(FirstlightError, match="not found"):
        make_proposer(SpecConfig("heads", heads_path=str(tmp_path / "missing.safetensors")), model, tok)
