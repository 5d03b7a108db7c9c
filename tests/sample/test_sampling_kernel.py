"""The C++ sampling kernel against the torch path it replaces for unfiltered random rows."""
from __future__ import annotations

import pytest
import torch
from sampler_utils import make_metadata

from pagellm.kernels import ops
from pagellm.sample.sampler import Sampler

pytestmark = pytest.mark.skipif(not ops.available(), reason="C++ kernels unavailable")


def _kernel(logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    ops.sample_from_logits(out, logits, temperature, u)
    return out


@pytest.mark.parametrize("vocab", [49152, 70, 5])  # the default model's, a ragged tail, a tail only
def test_kernel_inverts_the_same_cdf_as_torch(vocab: int) -> None:
    torch.manual_seed(vocab)
    rows = 400
    logits = torch.randn(rows, vocab) * 3
    temperature = torch.rand(rows) + 0.3
    u = torch.rand(rows)
    got = _kernel(logits, temperature, u)
    expected = Sampler()._torch_sample(logits.clone(), temperature.clone(), None, None, None, u.view(-1, 1))
    # Both are the first token whose cumulative probability exceeds u; they may differ only
    # where u sits within rounding of a CDF boundary.
    assert (got == expected).float().mean() >= 0.99
    probs = torch.softmax(logits / temperature[:, None], -1)
    cdf = probs.cumsum(-1)
    at = lambda idx: cdf.gather(1, idx[:, None]).squeeze(1)  # noqa: E731
    below = at(got) - probs.gather(1, got[:, None]).squeeze(1)
    assert torch.all(below <= u + 1e-5) and torch.all(at(got) >= u - 1e-5)


def test_banned_tokens_are_never_drawn_even_at_u_zero() -> None:
    logits = torch.randn(3, 100)
    logits[:, :10] = float("-inf")
    logits[1, 10:99] = float("-inf")  # only token 99 allowed
    for u in (0.0, 0.5, 0.9999999):
        got = _kernel(logits, torch.ones(3), torch.full((3,), u))
        assert torch.all(got >= 10) and got[1] == 99


def test_near_zero_temperature_samples_at_one() -> None:
    logits = torch.randn(2, 300)
    u = torch.tensor([0.3, 0.7])
    assert torch.equal(_kernel(logits, torch.tensor([0.0, 1e-6]), u), _kernel(logits, torch.ones(2), u))


def test_bad_arguments_raise_value_errors() -> None:
    with pytest.raises(ValueError, match="one per row"):
        _kernel(torch.randn(2, 10), torch.ones(3), torch.rand(2))
    with pytest.raises(ValueError, match="float32"):
        _kernel(torch.randn(2, 10, dtype=torch.float64), torch.ones(2), torch.rand(2))


def test_seeded_plain_row_is_the_same_next_to_filtered_rows() -> None:
    # A plain row takes the kernel whether or not other rows need top-p (the torch path).
    logits = torch.randn(3, 500) * 0.5
    sampler = Sampler()
    alone = sampler(logits[:1].clone(), make_metadata(1, seeds={0: (42, 3)})).sampled_token_ids
    mixed = sampler(logits.clone(), make_metadata(3, seeds={0: (42, 3)}, top_p=[1.0, 0.9, 0.5])).sampled_token_ids
    assert mixed[0] == alone[0]


def test_sampler_leaves_caller_logits_alone_on_every_path() -> None:
    logits = torch.randn(4, 300)
    before = logits.clone()
    sampler = Sampler()
    sampler(logits, make_metadata(4))  # kernel only: no copy is made
    sampler(logits, make_metadata(4, top_k=[0, 5, 0, 2]))  # mixed
    sampler(logits, make_metadata(4, logit_bias={1: {3: 5.0}}))  # edits in place: copied first
    assert torch.equal(logits, before)


@pytest.mark.parametrize("vocab", [1, 5, 16, 17, 100, 49152, 49157])  # below, at and past whole vectors
def test_argmax_kernel_equals_torch_argmax_with_ties_infinities_and_nan(vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    rows = [
        torch.randn(vocab, generator=gen),
        torch.round(torch.randn(vocab, generator=gen) * 2),  # many ties: the first one wins
        torch.full((vocab,), float("-inf")),  # nothing allowed: index 0
        torch.full((vocab,), float("inf")),
    ]
    with_nan = torch.randn(vocab, generator=gen)
    with_nan[vocab // 2] = float("nan")
    with_nan[-1] = float("nan")  # the first NaN wins, as in torch
    rows.append(with_nan)
    logits = torch.stack(rows)
    assert torch.equal(ops.argmax_rows(logits), logits.argmax(dim=-1))


def test_greedy_rows_use_the_argmax_kernel_and_match_torch(monkeypatch) -> None:
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(3))
    calls = []
    real = ops.argmax_rows
    monkeypatch.setattr(ops, "argmax_rows", lambda x: (calls.append(x.shape), real(x))[1])
    metadata = make_metadata(6, temperature=0.0)
    sampled = Sampler()(logits, metadata).sampled_token_ids
    assert calls == [(6, 300)]
    assert torch.equal(sampled, logits.argmax(dim=-1))
