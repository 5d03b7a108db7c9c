"""Speculative sampling keeps the target's distribution: greedy exactly, random by chi-square."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagellm.sample.rejection_sampler import RejectionSampler, SpecDecodeMetadata
from tests.sample.sampler_utils import make_metadata

# Chi-square critical values at p = 1e-4 (df -> value), so a correct sampler fails 1 run in 10,000.
_CHI2_CRIT = {2: 18.42, 3: 21.11, 4: 23.51, 5: 25.74}


def _top_p_probs(logits: torch.Tensor, top_p: float) -> np.ndarray:
    """Softmax, then keep the most likely tokens until their mass first reaches ``top_p``."""
    p = torch.softmax(logits.double(), dim=-1).numpy()
    order = np.argsort(-p)
    keep = np.zeros_like(p, dtype=bool)
    mass = 0.0
    for t in order:
        keep[t] = True
        mass += p[t]
        if mass >= top_p:
            break
    p = np.where(keep, p, 0.0)
    return p / p.sum()


def _chi2(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    n = counts.sum()
    support = probs > 0
    assert counts[~support].sum() == 0, f"tokens outside the distribution were drawn: {counts}"
    expected = n * probs[support]
    return float(((counts[support] - expected) ** 2 / expected).sum()), int(support.sum()) - 1


def _sample_many(row_logits: torch.Tensor, drafts: list[list[int]], top_p: float, draft_probs=None, seeds=None):
    """``row_logits`` [k + 1, V] shared by every request; one request per entry of ``drafts``."""
    k = row_logits.shape[0] - 1
    n = len(drafts)
    logits = row_logits.repeat(n, 1)
    metadata = make_metadata(n * (k + 1), temperature=1.0, top_p=[top_p] * (n * (k + 1)), seeds=seeds)
    spec = SpecDecodeMetadata(drafts, draft_probs)
    return RejectionSampler()(logits, metadata, spec).output_token_ids


LOGITS = torch.tensor([[2.0, 1.5, 1.0, 0.3, -1.0, -3.0], [0.2, 1.8, -0.5, 1.0, 0.9, -2.0], [1.0, 0.0, 2.0, -1.0, 0.5, 0.0]])


@pytest.mark.parametrize("draft", [0, 1, 4])
def test_ngram_drafts_keep_the_target_distribution_with_top_p(draft):
    """A point-mass draft (n-gram lookup) is accepted with probability p(d); the first token,
    and the second given that the first draft was accepted, follow the target's top-p softmax."""
    torch.manual_seed(1234 + draft)
    num = 6000
    outputs = _sample_many(LOGITS, [[draft, 3]] * num, top_p=0.9)
    first = np.bincount([o[0] for o in outputs], minlength=6)
    p0 = _top_p_probs(LOGITS[0], 0.9)
    stat, df = _chi2(first, p0)
    assert stat < _CHI2_CRIT[df], (first, p0)
    second = np.bincount([o[1] for o in outputs if o[0] == draft and len(o) > 1], minlength=6)
    if p0[draft] > 0:
        stat, df = _chi2(second, _top_p_probs(LOGITS[1], 0.9))
        assert stat < _CHI2_CRIT[df], second
    else:
        assert second.sum() == 0  # a draft outside top-p is never accepted


def test_draft_model_drafts_keep_the_target_distribution():
    """Drafts drawn from a draft distribution q: min(1, p/q) acceptance and the residual
    max(p - q, 0) give exactly p."""
    gen = torch.Generator().manual_seed(7)
    num = 6000
    q = torch.softmax(torch.tensor([[0.0, 2.0, 0.5, 0.5, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]]), dim=-1)
    d0 = torch.multinomial(q[0], num, replacement=True, generator=gen).tolist()
    d1 = torch.multinomial(q[1], num, replacement=True, generator=gen).tolist()
    torch.manual_seed(99)
    outputs = _sample_many(LOGITS, [[a, b] for a, b in zip(d0, d1)], top_p=0.9, draft_probs=[q] * num)
    first = np.bincount([o[0] for o in outputs], minlength=6)
    stat, df = _chi2(first, _top_p_probs(LOGITS[0], 0.9))
    assert stat < _CHI2_CRIT[df], first
    # Given any first token, the second follows row 1 (drafted from q[1], checked against p1).
    second = np.bincount([o[1] for o in outputs if len(o) > 1], minlength=6)
    stat, df = _chi2(second, _top_p_probs(LOGITS[1], 0.9))
    assert stat < _CHI2_CRIT[df], second
    accepted = sum(len(o) - 1 for o in outputs) / num
    assert 0.2 < accepted < 2.0


def test_greedy_accepts_while_drafts_are_the_argmax():
    logits = LOGITS.repeat(3, 1)  # argmaxes: 0, 1, 2
    metadata = make_metadata(9, temperature=0.0)
    spec = SpecDecodeMetadata([[0, 1], [0, 5], [3, 1]])
    out = RejectionSampler()(logits, metadata, spec)
    assert out.output_token_ids == [[0, 1, 2], [0, 1], [0]]


def test_seeded_rows_repeat_and_logprobs_report_each_output_token():
    seeds = {i: (42, i % 3) for i in range(6)}
    a = _sample_many(LOGITS, [[1, 3], [4, 4]], top_p=1.0, seeds=seeds)
    b = _sample_many(LOGITS, [[1, 3], [4, 4]], top_p=1.0, seeds=seeds)
    assert a == b
    metadata = make_metadata(3, temperature=0.0, max_num_logprobs=2)
    out = RejectionSampler()(LOGITS.clone(), metadata, SpecDecodeMetadata([[0, 3]]))
    assert out.output_token_ids == [[0, 1]]
    raw = torch.log_softmax(LOGITS, dim=-1)
    assert out.logprobs.token_ids[0, 0] == 0 and out.logprobs.token_ids[1, 0] == 1
    assert torch.allclose(out.logprobs.logprobs[0, 0], raw[0, 0]) and torch.allclose(out.logprobs.logprobs[1, 0], raw[1, 1])


def test_wrong_row_count_is_refused():
    with pytest.raises(ValueError, match="verification rows"):
        RejectionSampler()(LOGITS, make_metadata(3), SpecDecodeMetadata([[1]]))
