"""The rejection sampler is lossless: its output follows the target distribution (vLLM's test)."""

import pytest
import torch

from firstlight.engine.speculative.rejection import rejection_sample

VOCAB = 10


def _empirical_first_token(target, draft, n, seed, one_hot=False):
    """Sample n rows with k=2 proposals drawn from `draft`; histogram of the first emitted token."""
    gen = torch.Generator().manual_seed(seed)
    k = 2
    if one_hot:  # deterministic proposals: always token 3 then 7
        ids = torch.tensor([[3, 7]]).expand(n, k)
        q = None
    else:
        ids = torch.multinomial(draft, n * k, replacement=True, generator=gen).reshape(k, n).T  # [n, k]
        q = draft.expand(n, k, VOCAB)
    p = target.expand(n, k + 1, VOCAB)
    out = rejection_sample(p, ids, [k] * n, q, shared_generator=gen)
    first = torch.tensor([o[0] for o in out])
    return torch.bincount(first, minlength=VOCAB).float() / n


@pytest.mark.parametrize("one_hot", [False, True])
def test_distance_to_target_shrinks_like_inverse_sqrt_n(one_hot):
    g = torch.Generator().manual_seed(0)
    target = torch.softmax(torch.randn(VOCAB, generator=g) * 2, -1)
    draft = torch.softmax(torch.randn(VOCAB, generator=g) * 2, -1)
    unrelated = torch.softmax(torch.randn(VOCAB, generator=g) * 2, -1)
    dist_target, dist_unrelated = {}, {}
    for n in (10, 100, 1000, 10_000, 100_000):
        emp = _empirical_first_token(target, draft, n, seed=n, one_hot=one_hot)
        dist_target[n] = float((emp - target).norm())
        dist_unrelated[n] = float((emp - unrelated).norm())
    # ~1/sqrt(n): 10_000x more samples, ~100x closer (allow a factor 5 of noise)
    assert dist_target[100_000] < dist_target[10] / 20
    assert dist_target[100_000] < 5 / (100_000 ** 0.5)
    # the distance to an unrelated distribution does not shrink
    assert dist_unrelated[100_000] > 0.5 * dist_unrelated[10] or dist_unrelated[100_000] > 0.1
    assert dist_unrelated[100_000] > 10 * dist_target[100_000]


def test_all_positions_follow_target():
    """Second emitted token (when the first proposal is accepted) also follows the target."""
    g = torch.Generator().manual_seed(1)
    n, k = 50_000, 2
    target = torch.softmax(torch.randn(k + 1, VOCAB, generator=g), -1)
    draft = torch.softmax(torch.randn(k, VOCAB, generator=g), -1)
    ids = torch.stack([torch.multinomial(draft[i], n, replacement=True, generator=g) for i in range(k)], 1)
    out = rejection_sample(target.expand(n, -1, -1), ids, [k] * n, draft.expand(n, -1, -1), shared_generator=g)
    # target here depends on position only, so tokens at emitted index 1 follow target[1]
    second = torch.tensor([o[1] for o in out if len(o) > 1])
    emp = torch.bincount(second, minlength=VOCAB).float() / len(second)
    assert float((emp - target[1]).norm()) < 0.02


def test_greedy_is_exact_match_and_bonus():
    p = torch.zeros(2, 4, VOCAB)
    p[:, 0, 5] = p[:, 1, 6] = p[:, 2, 7] = p[:, 3, 8] = 1.0
    ids = torch.tensor([[5, 6, 7], [5, 0, 7]])
    out = rejection_sample(p, ids, [3, 3], is_greedy=[True, True])
    assert out == [[5, 6, 7, 8], [5, 6]]


def test_variable_proposal_lengths_and_row_generators_reproduce():
    g = torch.Generator().manual_seed(2)
    p = torch.softmax(torch.randn(3, 4, VOCAB, generator=g), -1)
    ids = torch.tensor([[1, 2, 3], [4, 0, 0], [0, 0, 0]])

    def run(seed_row0):
        gens = [torch.Generator().manual_seed(seed_row0), torch.Generator().manual_seed(9), None]
        return rejection_sample(p, ids, [3, 1, 0], generators=gens, shared_generator=torch.Generator().manual_seed(5))

    a, b = run(7), run(7)
    assert a == b
    assert 1 <= len(a[0]) <= 4 and 1 <= len(a[1]) <= 2 and len(a[2]) == 1


def _proposer_under_test(method, tiny, tiny_checkpoint):
    from firstlight.engine.speculative.config import SpecConfig
    from firstlight.engine.speculative.heads import HeadsProposer
    from firstlight.engine.speculative.medusa import MedusaHeads
    from firstlight.engine.speculative.registry import make_proposer
    from firstlight.models.loader import load_model

    if method == "mtp":  # a tiny random Qwen3-Next with its one MTP layer
        model, tok = load_model(tiny_checkpoint("qwen3_next", seed=2))
        return model.eval(), make_proposer(SpecConfig("mtp"), model, tok)
    model, tok = tiny
    if method == "draft":
        return model, make_proposer(SpecConfig("draft", draft_layers=2), model, tok)
    heads = MedusaHeads(model.config.hidden_size, 2)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(0.5 * torch.randn(p.shape, generator=g))
    return model, HeadsProposer(model, heads)


@pytest.mark.parametrize("method", ["draft", "heads", "mtp"])
def test_proposer_drafts_keep_the_target_distribution(tiny, tiny_checkpoint, method):
    """The same losslessness, end to end with a real proposer: its sampled drafts and the q it reports
    for them, through the rejection sampler, give first tokens distributed as the target's p (T = 0.5),
    not as the proposer's q. A proposer whose q is not what it drew from fails this: the MTP proposer
    reporting q at T = 1 while drawing at T = 0.5 shifts the output by 0.024 (L2), over the bound."""
    from firstlight.engine.speculative.base import SpecRequest

    model, proposer = _proposer_under_test(method, tiny, tiny_checkpoint)
    context, n, k, temperature = [1, 40, 41, 42, 43, 40, 41], 10_000, 2, 0.5
    with torch.inference_mode():
        hidden = model.forward_hidden(torch.tensor([context]), torch.arange(len(context))[None])[0]  # [N, E]
        p1 = torch.softmax(model.compute_logits(hidden[-1]).float() / temperature, -1)  # [V]
    gen = torch.Generator().manual_seed(0)
    requests = [SpecRequest(f"r{i}", context, k, temperature, gen, hidden=hidden[-2], hidden_states=hidden[:-1])
                for i in range(n)]
    proposals = proposer.propose(requests)
    ids = torch.tensor([prop.token_ids for prop in proposals])  # [n, k]
    q = torch.stack([prop.probs for prop in proposals])  # [n, k, V]
    q1 = q[0, 0]
    assert torch.allclose(q[:, 0], q1.expand(n, -1), atol=1e-5)  # one context: one q for the first draft
    assert float((p1 - q1).norm()) > 0.1  # the proposer disagrees with the target: the test can tell
    # the first emitted token depends on p at the first position only
    out = rejection_sample(p1.expand(n, k + 1, -1), ids, [k] * n, q, shared_generator=gen)
    emp = torch.bincount(torch.tensor([o[0] for o in out]), minlength=len(p1)).float() / n
    # n |emp - p|^2 has mean 1 - sum p^2 and variance <= 2 sum p^2 (multinomial, Gaussian limit): 6 sd
    sum_p2 = float((p1 * p1).sum())
    bound = ((1 - sum_p2 + 6 * (2 * sum_p2) ** 0.5) / n) ** 0.5
    assert float((emp - p1).norm()) < bound
    assert float((emp - q1).norm()) > 3 * float((emp - p1).norm())
