import pytest
import torch

from pagellm.sample.penalties import apply_bad_token_ids, apply_logit_bias, apply_penalties, pad_token_ids, token_counts

NEG_INF = float("-inf")


def test_penalties_match_hand_computed_values() -> None:
    logits = torch.tensor([
        [2.0, -1.0, 0.5, 3.0, -2.0],
        [2.0, -1.0, 0.5, 3.0, -2.0],  # neutral settings: untouched
        [2.0, -1.0, 0.5, 3.0, -2.0],  # repetition only, prompt-only tokens count too
    ])
    prompt = torch.tensor([[1, 5, 5], [0, 1, 2], [4, 0, 5]])  # 5 = vocab size = padding
    out = apply_penalties(
        logits.clone(),
        prompt,
        [[3, 3, 2], [3, 3, 3], []],
        presence_penalties=torch.tensor([0.3, 0.0, 0.0]),
        frequency_penalties=torch.tensor([0.5, 0.0, 0.0]),
        repetition_penalties=torch.tensor([2.0, 1.0, 1.25]),
    )
    expected = torch.tensor([
        # tok1 prompt & negative: -1 * 2; tok2: 0.5 / 2 - 0.5 - 0.3; tok3: 3 / 2 - 2 * 0.5 - 0.3.
        [2.0, -2.0, -0.55, 0.2, -2.0],
        [2.0, -1.0, 0.5, 3.0, -2.0],
        [2.0 / 1.25, -1.0, 0.5, 3.0, -2.0 * 1.25],
    ])
    torch.testing.assert_close(out, expected)


def test_presence_and_frequency_count_output_only() -> None:
    logits = torch.zeros(1, 4)
    out = apply_penalties(logits, torch.tensor([[0, 0, 0]]), [[1, 1, 1, 2]],
                          presence_penalties=torch.tensor([1.0]), frequency_penalties=torch.tensor([0.25]),
                          repetition_penalties=torch.tensor([1.0]))
    # Token 0 is only in the prompt: no presence / frequency penalty.
    torch.testing.assert_close(out, torch.tensor([[0.0, -1.75, -1.25, 0.0]]))


def test_negative_penalties_encourage() -> None:
    out = apply_penalties(torch.zeros(1, 3), None, [[2]], presence_penalties=torch.tensor([-1.0]),
                          frequency_penalties=torch.tensor([-0.5]), repetition_penalties=None)
    torch.testing.assert_close(out, torch.tensor([[0.0, 0.0, 1.5]]))


def test_repetition_keeps_minus_inf() -> None:
    logits = torch.tensor([[NEG_INF, 1.0, -1.0]])
    out = apply_penalties(logits, None, [[0, 1, 2]], None, None, torch.tensor([1.5]))
    assert out[0, 0] == NEG_INF
    torch.testing.assert_close(out[0, 1:], torch.tensor([1.0 / 1.5, -1.5]))


def test_output_rows_must_match() -> None:
    with pytest.raises(ValueError, match="output_token_ids"):
        apply_penalties(torch.zeros(2, 3), None, [[1]], torch.zeros(2), None, None)


def test_token_counts_ignore_padding() -> None:
    ids = torch.tensor([[0, 2, 2, 3, -1], [3, 3, 3, 3, 3]])
    counts = token_counts(ids, 3)
    assert counts.tolist() == [[1.0, 0.0, 2.0], [0.0, 0.0, 0.0]]
    padded = pad_token_ids([[1, 2], [], [0]], pad_id=9, device=torch.device("cpu"))
    assert padded.tolist() == [[1, 2], [9, 9], [0, 9]]
    assert pad_token_ids([[], []], 9, torch.device("cpu")).shape == (2, 0)


def test_logit_bias_and_bad_tokens_in_place() -> None:
    logits = torch.zeros(3, 4)
    apply_logit_bias(logits, {0: {1: 2.0, 3: -1.5}, 2: {0: 0.5}})
    apply_bad_token_ids(logits, {1: [0, 2], 2: [3]})
    expected = torch.tensor([[0.0, 2.0, 0.0, -1.5], [NEG_INF, 0.0, NEG_INF, 0.0], [0.5, 0.0, 0.0, NEG_INF]])
    assert torch.equal(logits, expected)


def test_out_of_range_rows_raise() -> None:
    with pytest.raises(ValueError, match="row 5"):
        apply_logit_bias(torch.zeros(2, 4), {5: {0: 1.0}})
    with pytest.raises(ValueError, match="row 2"):
        apply_bad_token_ids(torch.zeros(2, 4), {2: [0]})
