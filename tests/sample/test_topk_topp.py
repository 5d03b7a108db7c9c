import math

import torch

from pagellm.sample.topk_topp import apply_min_p, apply_top_k_only, apply_top_k_top_p

NEG_INF = float("-inf")


def kept(logits: torch.Tensor) -> list[set[int]]:
    return [set(torch.nonzero(row > NEG_INF).flatten().tolist()) for row in logits]


# Probabilities in a shuffled order so that sorting is really exercised.
PROBS = torch.tensor([0.15, 0.5, 0.1, 0.25])  # order by likelihood: 1, 3, 0, 2


def test_top_k_keeps_exactly_k_largest() -> None:
    logits = torch.tensor([[0.5, 3.0, 1.0, 2.0, 2.5, -1.0]]).repeat(5, 1)
    k = torch.tensor([1, 3, 0, 6, 10])  # 0 disables, >= V keeps all
    expected = [{1}, {1, 3, 4}, set(range(6)), set(range(6)), set(range(6))]
    assert kept(apply_top_k_only(logits.clone(), k)) == expected
    assert kept(apply_top_k_top_p(logits.clone(), k, torch.ones(5))) == expected
    out = apply_top_k_only(logits.clone(), k)
    assert torch.equal(out[1, [1, 3, 4]], logits[1, [1, 3, 4]])  # kept values unchanged


def test_top_k_all_disabled_is_noop() -> None:
    logits = torch.randn(2, 7)
    assert torch.equal(apply_top_k_only(logits.clone(), torch.tensor([0, -1])), logits)


def test_top_p_keeps_smallest_set_reaching_p() -> None:
    logits = torch.log(PROBS).repeat(5, 1)
    p = torch.tensor([0.4, 0.7, 0.8, 0.95, 1.0])
    # Masses above each token: 1 -> 0, 3 -> 0.5, 0 -> 0.75, 2 -> 0.9; kept iff below p.
    expected = [{1}, {1, 3}, {0, 1, 3}, {0, 1, 2, 3}, {0, 1, 2, 3}]
    assert kept(apply_top_k_top_p(logits.clone(), None, p)) == expected


def test_top_p_after_top_k_renormalizes() -> None:
    logits = torch.log(PROBS).repeat(2, 1)
    # After top-3 the masses are .5/.9, .25/.9, .15/.9: token 0 has .833 above it, > 0.8.
    out = apply_top_k_top_p(logits.clone(), torch.tensor([3, 0]), torch.tensor([0.8, 0.8]))
    assert kept(out) == [{1, 3}, {0, 1, 3}]
    torch.testing.assert_close(out[0, [1, 3]], logits[0, [1, 3]])


def test_min_p_relative_to_top_probability() -> None:
    logits = torch.log(PROBS).repeat(4, 1) + 7.0  # shift: min_p depends on probabilities only
    min_p = torch.tensor([0.0, 0.25, 0.4, 1.0])
    # Thresholds: 0, .125, .2, .5 times... of p_max = .5.
    expected = [{0, 1, 2, 3}, {0, 1, 3}, {1, 3}, {1}]
    assert kept(apply_min_p(logits.clone(), min_p)) == expected


def test_min_p_matches_probability_definition_on_random_logits() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(32, 100, generator=g) * 2
    min_p = torch.rand(32, generator=g)
    probs = torch.softmax(logits, -1)
    expected = probs >= min_p[:, None] * probs.max(-1, keepdim=True).values
    got = apply_min_p(logits.clone(), min_p) > NEG_INF
    # Allow disagreement only where a probability sits within float error of the threshold.
    differ = expected != got
    ratio = probs / (min_p[:, None] * probs.max(-1, keepdim=True).values)
    assert bool(((ratio[differ] - 1).abs() < 1e-5).all())


def test_top_p_matches_reference_on_random_logits() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(16, 50, generator=g) * 2
    p = torch.rand(16, generator=g) * 0.9 + 0.05
    got = kept(apply_top_k_top_p(logits.clone(), None, p))
    probs = torch.softmax(logits, -1)
    for row in range(16):
        order = probs[row].argsort(descending=True).tolist()
        total, keep = 0.0, set()
        for token in order:
            if total >= p[row].item():
                break
            keep.add(token)
            total += probs[row, token].item()
        assert got[row] == keep
    assert math.isfinite(float(logits.sum()))


def test_candidate_nucleus_matches_full_sort_on_a_large_vocabulary():
    from pagellm.sample.topk_topp import NUCLEUS_CANDIDATES, _apply_top_k_top_p_sorted

    torch.manual_seed(0)
    vocab = 4 * NUCLEUS_CANDIDATES
    peaked = torch.randn(6, vocab) * 4.0  # nucleus well inside the candidates
    flat = torch.randn(4, vocab) * 0.01  # nucleus spans most of the vocabulary: the fallback
    logits = torch.cat([peaked, flat])
    top_p = torch.tensor([0.5, 0.9, 0.99, 1.0, 0.7, 0.95, 0.5, 0.9, 0.3, 1.0])
    for top_k in (None, torch.tensor([0, 5, 2000, 0, 1, 4096, 0, 3000, 10, 0])):
        fast = apply_top_k_top_p(logits.clone(), top_k, top_p)
        slow = _apply_top_k_top_p_sorted(logits.clone(), top_k, top_p)
        assert torch.equal(torch.isinf(fast), torch.isinf(slow))
        kept = ~torch.isinf(fast)
        assert torch.equal(fast[kept], logits[kept])
