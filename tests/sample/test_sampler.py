import math

import pytest
import torch
from sampler_utils import make_metadata

from pagellm.sample.sampler import Sampler, derive_step_seed

VOCAB = 64


def random_logits(num_rows: int, vocab: int = VOCAB, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, vocab, generator=g) * scale


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# Upper 0.1% points of the chi-square distribution.
CHI2_999 = {3: 16.27, 4: 18.47, 5: 20.52}


def test_greedy_equals_argmax() -> None:
    logits = random_logits(8)
    out = Sampler()(logits, make_metadata(8, temperature=0.0))
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.logprobs is None


def test_sampler_does_not_modify_input_logits() -> None:
    logits = random_logits(4)
    before = logits.clone()
    Sampler()(logits, make_metadata(4, temperature=0.7, top_k=[3, 0, 5, 1], top_p=[0.9, 0.5, 1.0, 1.0],
                                    repetition=[1.5] * 4, output_token_ids=[[1], [2], [], [3]],
                                    logit_bias={0: {5: 3.0}}, bad_token_ids={1: [7]}))
    assert torch.equal(logits, before)


def test_top_k_one_equals_greedy() -> None:
    logits = random_logits(16, seed=1)
    for step in range(5):
        torch.manual_seed(step)
        out = Sampler()(logits, make_metadata(16, temperature=1.5, top_k=[1] * 16))
        assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


def test_near_zero_temperature_is_argmax() -> None:
    logits = random_logits(16, seed=2)
    # Random (non-greedy) rows at a tiny temperature: the top token's share is ~1 whenever the
    # runner-up is even slightly behind, which these random logits always are.
    for step in range(5):
        torch.manual_seed(step)
        out = Sampler()(logits, make_metadata(16, temperature=1e-3))
        assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


def test_zero_temperature_rows_in_mixed_batch_are_greedy() -> None:
    logits = random_logits(6, seed=3, scale=0.1)  # flat: random rows almost never hit the argmax
    temps = [0.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    torch.manual_seed(0)
    sampled = torch.stack([Sampler()(logits, make_metadata(6, temperature=temps)).sampled_token_ids for _ in range(20)])
    argmax = logits.argmax(-1)
    for row in (0, 2, 4):
        assert (sampled[:, row] == argmax[row]).all()
    # The random rows really are sampled, not silently greedy.
    assert any(len(set(sampled[:, row].tolist())) > 1 for row in (1, 3, 5))


def test_high_temperature_flattens_distribution() -> None:
    logits = torch.log(torch.tensor([0.7, 0.2, 0.1])).repeat(30000, 1)
    torch.manual_seed(1)
    out = Sampler()(logits, make_metadata(30000, temperature=2.0))
    counts = torch.bincount(out.sampled_token_ids, minlength=3).float()
    expected = torch.softmax(logits[0] / 2.0, -1)
    assert chi_square(counts, expected) < 16.0  # df = 2, p ~ 3e-4


def test_sampling_distribution_matches_softmax() -> None:
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.07, 0.03])
    num_draws = 40000
    logits = torch.log(probs).repeat(num_draws, 1)
    torch.manual_seed(1234)
    out = Sampler()(logits, make_metadata(num_draws))
    counts = torch.bincount(out.sampled_token_ids, minlength=6).float()
    assert chi_square(counts, probs) < CHI2_999[5]


def test_seeded_sampling_distribution_matches_softmax() -> None:
    # Every row has its own seed: checks the seeded path draws from the right distribution.
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    num_draws = 4000
    logits = torch.log(probs).repeat(num_draws, 1)
    seeds = {row: (row, 0) for row in range(num_draws)}
    out = Sampler()(logits, make_metadata(num_draws, seeds=seeds))
    counts = torch.bincount(out.sampled_token_ids, minlength=4).float()
    assert chi_square(counts, probs) < CHI2_999[3]


def _seeded_tokens(row_logits: torch.Tensor, seed: int, steps: int, others: int, position: int) -> list[int]:
    """Samples `steps` tokens for one seeded row embedded at `position` among unseeded rows."""
    sampler = Sampler()
    tokens = []
    for step in range(steps):
        batch = random_logits(others + 1, seed=100 + step + others)
        batch[position] = row_logits
        seeds = {position: (seed, step)}
        meta = make_metadata(others + 1, temperature=[1.0] * (others + 1), seeds=seeds,
                             top_p=[0.95] * (others + 1))
        tokens.append(int(sampler(batch, meta).sampled_token_ids[position]))
    return tokens


def test_seeded_row_independent_of_batch_composition_and_order() -> None:
    row_logits = random_logits(1, seed=7, scale=0.5)[0]
    reference = _seeded_tokens(row_logits, seed=42, steps=30, others=0, position=0)
    assert len(set(reference)) > 5  # a flat distribution: the draws really vary step to step
    assert _seeded_tokens(row_logits, seed=42, steps=30, others=7, position=3) == reference
    assert _seeded_tokens(row_logits, seed=42, steps=30, others=12, position=12) == reference
    torch.manual_seed(999)  # the default generator's state must not matter either
    assert _seeded_tokens(row_logits, seed=42, steps=30, others=4, position=0) == reference


def test_seeded_rows_with_other_seeded_rows_and_row_order() -> None:
    logits = random_logits(3, seed=8, scale=0.5)
    seeds = {0: (1, 5), 1: (2, 5), 2: (3, 5)}
    out = Sampler()(logits, make_metadata(3, seeds=seeds)).sampled_token_ids
    perm = [2, 0, 1]
    permuted_seeds = {new: seeds[old] for new, old in enumerate(perm)}
    out_perm = Sampler()(logits[perm], make_metadata(3, seeds=permuted_seeds)).sampled_token_ids
    assert out_perm.tolist() == [out[old].item() for old in perm]


def test_seeded_resume_after_preemption_matches() -> None:
    # A request recomputed after preemption resumes at step k with the same (seed, k) draws.
    row_logits = random_logits(1, seed=9, scale=0.5)
    sampler = Sampler()
    first = [int(sampler(row_logits, make_metadata(1, seeds={0: (5, k)})).sampled_token_ids[0]) for k in range(20)]
    resumed = [int(Sampler()(row_logits, make_metadata(1, seeds={0: (5, k)})).sampled_token_ids[0]) for k in range(10, 20)]
    assert resumed == first[10:]


def test_different_seeds_differ() -> None:
    row_logits = random_logits(1, seed=10, scale=0.3)
    a = [int(Sampler()(row_logits, make_metadata(1, seeds={0: (1, k)})).sampled_token_ids[0]) for k in range(30)]
    b = [int(Sampler()(row_logits, make_metadata(1, seeds={0: (2, k)})).sampled_token_ids[0]) for k in range(30)]
    assert a != b
    assert derive_step_seed(1, 0) != derive_step_seed(2, 0) != derive_step_seed(1, 1)
    assert derive_step_seed(-1, 3) == derive_step_seed(-1, 3)
    assert 0 <= derive_step_seed(-(2**70), 2**70) < 2**64


def test_bad_token_ids_never_sampled() -> None:
    num_rows = 5000
    logits = torch.zeros(num_rows, 10)
    logits[:, 3] = 2.0  # the most likely token is among the banned ones
    banned = [3, 5, 9]
    torch.manual_seed(0)
    out = Sampler()(logits, make_metadata(num_rows, bad_token_ids={r: banned for r in range(num_rows)}))
    assert not torch.isin(out.sampled_token_ids, torch.tensor(banned)).any()
    greedy = Sampler()(logits[:1], make_metadata(1, temperature=0.0, bad_token_ids={0: [3]}))
    assert greedy.sampled_token_ids.item() != 3


def test_bad_token_ids_only_for_listed_rows() -> None:
    logits = torch.zeros(2, 4)
    logits[:, 2] = 5.0
    out = Sampler()(logits, make_metadata(2, temperature=0.0, bad_token_ids={1: [2]}))
    assert out.sampled_token_ids[0].item() == 2
    assert out.sampled_token_ids[1].item() != 2


def test_logit_bias() -> None:
    logits = torch.tensor([[1.0, 2.0, 0.0], [1.0, 2.0, 0.0]])
    out = Sampler()(logits, make_metadata(2, temperature=0.0, logit_bias={0: {2: 2.5}}))
    assert out.sampled_token_ids.tolist() == [2, 1]
    # -100 makes a token practically impossible even when it is the most likely one.
    num_rows = 3000
    torch.manual_seed(0)
    flat = torch.zeros(num_rows, 4)
    out = Sampler()(flat, make_metadata(num_rows, logit_bias={r: {1: -100.0} for r in range(num_rows)}))
    assert not (out.sampled_token_ids == 1).any()
    assert set(out.sampled_token_ids.tolist()) == {0, 2, 3}


def test_logit_bias_out_of_vocab_raises() -> None:
    with pytest.raises(ValueError, match="outside the vocabulary"):
        Sampler()(torch.zeros(1, 4), make_metadata(1, logit_bias={0: {4: 1.0}}))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        Sampler()(torch.zeros(1, 4), make_metadata(1, bad_token_ids={0: [-1]}))


def test_penalties_change_greedy_choice() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    meta = make_metadata(1, temperature=0.0, repetition=[2.0], frequency=[0.5], presence=[0.3],
                         output_token_ids=[[3, 3, 2]], prompt_token_ids=torch.tensor([[1, 5, 5]]))
    # Token 3: 3.0 / 2 - 0.5 * 2 - 0.3 = 0.2 < token 0's untouched 2.0.
    assert Sampler()(logits, meta).sampled_token_ids.item() == 0


def test_top_k_restricts_support() -> None:
    num_rows = 4000
    base = torch.tensor([0.5, 3.0, 1.0, 2.0, 2.5, -1.0])
    logits = base.repeat(num_rows, 1)
    torch.manual_seed(0)
    out = Sampler()(logits, make_metadata(num_rows, top_k=[3] * num_rows))
    assert set(out.sampled_token_ids.tolist()) == {1, 3, 4}
    counts = torch.bincount(out.sampled_token_ids, minlength=6)[[1, 3, 4]].float()
    assert chi_square(counts, torch.softmax(base[[1, 3, 4]], -1)) < 13.8  # df = 2, p = 0.001


def test_top_p_and_min_p_restrict_support() -> None:
    probs = torch.tensor([0.1, 0.5, 0.15, 0.25])
    num_rows = 3000
    logits = torch.log(probs).repeat(num_rows, 1)
    torch.manual_seed(0)
    out = Sampler()(logits, make_metadata(num_rows, top_p=[0.7] * num_rows))
    assert set(out.sampled_token_ids.tolist()) == {1, 3}
    out = Sampler()(logits, make_metadata(num_rows, min_p=[0.25] * num_rows))
    assert set(out.sampled_token_ids.tolist()) == {1, 2, 3}
    # min_p applies to the tempered distribution: at T=0.5, p ∝ p^2 = [.01, .25, .0225, .0625].
    out = Sampler()(logits, make_metadata(num_rows, temperature=0.5, min_p=[0.2] * num_rows))
    assert set(out.sampled_token_ids.tolist()) == {1, 3}


def test_logprobs_are_raw_and_ranked() -> None:
    logits = random_logits(5, seed=11)
    meta = make_metadata(5, temperature=[0.0, 0.8, 1.0, 0.0, 2.0], repetition=[1.8] * 5,
                         output_token_ids=[[0], [1], [2], [3], [4]], logit_bias={1: {7: 5.0}},
                         top_k=[0, 5, 0, 0, 3], max_num_logprobs=4)
    torch.manual_seed(0)
    out = Sampler()(logits, meta)
    lp = out.logprobs
    assert lp is not None
    raw = torch.log_softmax(logits, -1)
    sampled = out.sampled_token_ids
    assert lp.token_ids.shape == (5, 5) and lp.logprobs.shape == (5, 5)
    assert torch.equal(lp.token_ids[:, 0], sampled)
    torch.testing.assert_close(lp.logprobs[:, 0], raw.gather(1, sampled[:, None])[:, 0])
    top = raw.topk(4, -1)
    assert torch.equal(lp.token_ids[:, 1:], top.indices)
    torch.testing.assert_close(lp.logprobs[:, 1:], top.values)
    for row in range(5):
        expected_rank = 1 + int((raw[row] > raw[row, sampled[row]]).sum())
        assert lp.ranks[row].item() == expected_rank


def test_logprobs_zero_top_gives_only_sampled_column() -> None:
    logits = random_logits(3, seed=12)
    out = Sampler()(logits, make_metadata(3, temperature=0.0, max_num_logprobs=0))
    assert out.logprobs is not None
    assert out.logprobs.token_ids.shape == (3, 1)
    assert out.logprobs.ranks.tolist() == [1, 1, 1]  # greedy picks the top token
    torch.testing.assert_close(out.logprobs.logprobs[:, 0], torch.log_softmax(logits, -1).max(-1).values)


def test_bad_shapes_raise() -> None:
    with pytest.raises(ValueError, match=r"\[B, V\]"):
        Sampler()(torch.zeros(4), make_metadata(4))
    with pytest.raises(ValueError, match="3 rows"):
        Sampler()(torch.zeros(3, 5), make_metadata(2))
    with pytest.raises(ValueError, match="seeded row"):
        Sampler()(torch.zeros(1, 5), make_metadata(1, seeds={0: (1, 0), 3: (1, 0)}))


def test_half_precision_logits_accepted() -> None:
    logits = random_logits(4, seed=13).to(torch.bfloat16)
    out = Sampler()(logits, make_metadata(4, temperature=0.0, max_num_logprobs=2))
    assert torch.equal(out.sampled_token_ids, logits.float().argmax(-1))
    assert out.logprobs is not None and out.logprobs.logprobs.dtype == torch.float32
    assert math.isfinite(float(out.logprobs.logprobs.sum()))
