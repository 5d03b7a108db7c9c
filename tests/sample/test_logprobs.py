import pytest
import torch

import pagellm.sample.logprobs as logprobs_module
from pagellm.sample.logprobs import compute_prompt_logprobs, gather_logprobs


def test_gather_logprobs_layout_and_ranks() -> None:
    logprobs = torch.log_softmax(torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 1.0]]), -1)
    out = gather_logprobs(logprobs, 2, torch.tensor([2, 3]))
    assert out.token_ids.tolist() == [[2, 1, 2], [3, 2, 3]]
    torch.testing.assert_close(out.logprobs, logprobs.gather(1, out.token_ids))
    assert out.ranks.tolist() == [2, 2]


def test_rank_counts_ties_as_better() -> None:
    logprobs = torch.log_softmax(torch.tensor([[1.0, 1.0, 0.0]]), -1)
    assert gather_logprobs(logprobs, 1, torch.tensor([1])).ranks.tolist() == [2]


def test_prompt_logprobs_match_log_softmax(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(37, 50, generator=g)
    targets = torch.randint(0, 50, (37,), generator=g)
    whole = compute_prompt_logprobs(logits, targets, 5)
    ref = torch.log_softmax(logits, -1)
    torch.testing.assert_close(whole.logprobs[:, 0], ref.gather(1, targets[:, None])[:, 0])
    assert torch.equal(whole.token_ids[:, 0], targets)
    assert torch.equal(whole.token_ids[:, 1:], ref.topk(5, -1).indices)
    expected_ranks = (ref >= ref.gather(1, targets[:, None])).sum(-1)
    assert torch.equal(whole.ranks, expected_ranks)
    # Force the chunked path (8 rows a chunk): identical results.
    monkeypatch.setattr(logprobs_module, "_PROMPT_CHUNK_ELEMENTS", 8 * 50)
    chunked = compute_prompt_logprobs(logits, targets, 5)
    assert torch.equal(chunked.token_ids, whole.token_ids)
    torch.testing.assert_close(chunked.logprobs, whole.logprobs)
    assert torch.equal(chunked.ranks, whole.ranks)


def test_prompt_logprobs_empty_and_invalid() -> None:
    empty = compute_prompt_logprobs(torch.zeros(0, 10), torch.zeros(0, dtype=torch.int64), 3)
    assert empty.token_ids.shape == (0, 4) and empty.ranks.shape == (0,)
    with pytest.raises(ValueError, match="target_token_ids"):
        compute_prompt_logprobs(torch.zeros(3, 10), torch.zeros(2, dtype=torch.int64), 1)
    with pytest.raises(ValueError, match="num_logprobs"):
        compute_prompt_logprobs(torch.zeros(3, 10), torch.zeros(3, dtype=torch.int64), 11)
