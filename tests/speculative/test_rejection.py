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
