"""The reasoning section in token ids: where it ends, the thinking budget's forced end, and grammars that wait for it."""
from __future__ import annotations

import pytest
import torch

from pagellm import SamplingParams, StructuredOutputsParams
from pagellm.models.loader import default_model_path
from pagellm.structured_output import StructuredOutputManager
from pagellm.structured_output.reasoning import ReasoningBounds, ReasoningTracker, reasoning_ended
from pagellm.tokenizer import load_tokenizer

START, END = (7, 8), (9,)  # a two-token start marker and a one-token end marker
BOUNDS = ReasoningBounds(START, END, (5, 9))  # forced: a token, then the end marker


@pytest.mark.parametrize(
    "prompt, ended",
    [
        ([1, 2, 3], False),  # no marker: the model is about to open its reasoning itself
        ([1, 7, 8], False),  # the template opened it
        ([1, 7, 8, 4, 9], True),  # opened and closed (thinking turned off)
        ([7, 8, 9, 1, 7, 8], False),  # a closed one earlier, a new one open now
        ([1, 8], False),  # half a start marker is no marker
    ],
)
def test_prompt_decides_where_the_output_starts(prompt, ended):
    assert reasoning_ended(BOUNDS, prompt) is ended


def test_end_marker_ends_the_reasoning_and_counts_its_tokens():
    t = ReasoningTracker(BOUNDS, [7, 8], budget=None)
    assert [t.accept(x) for x in (4, 4, 9)] == [False, False, False]
    assert t.ended and t.num_reasoning_tokens == 3
    assert t.accept(4) is True and t.num_reasoning_tokens == 3
    assert t.forced_token() is None


@pytest.mark.parametrize("budget", [0, 1, 3])
def test_budget_forces_the_end_after_exactly_budget_tokens(budget):
    t = ReasoningTracker(BOUNDS, [7, 8], budget=budget)
    out = []
    for _ in range(20):
        forced = t.forced_token()
        token = forced if forced is not None else 4
        out.append(token)
        t.accept(token)
        if t.ended:
            break
    assert out == [4] * budget + [5, 9]
    assert t.ended and t.forced_token() is None


def test_budget_is_not_forced_once_the_model_ended_by_itself_or_when_thinking_is_off():
    t = ReasoningTracker(BOUNDS, [7, 8], budget=2)
    t.accept(9)
    assert t.ended and t.forced_token() is None
    off = ReasoningTracker(BOUNDS, [7, 8, 9], budget=0)
    assert off.ended and off.forced_token() is None


def test_forced_end_that_does_not_end_with_the_marker_still_ends():
    t = ReasoningTracker(ReasoningBounds(START, END, (5, 6)), [7, 8], budget=0)
    assert t.forced_token() == 5
    t.accept(5)
    assert t.forced_token() == 6
    t.accept(6)
    assert t.ended


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="end string"):
        ReasoningBounds((1,), (), (2,))


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_path())


def test_manager_grammar_waits_for_the_end_and_budget_forces_it(tokenizer):
    vocab = 49152
    think, end = tokenizer.encode("<think>", add_special_tokens=False), tokenizer.encode("</think>", add_special_tokens=False)
    bounds = ReasoningBounds(tuple(think), tuple(end), tuple(end))
    manager = StructuredOutputManager(tokenizer, vocab, {2}, bounds)
    params = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes", "no"]), thinking_token_budget=2)
    prompt = [1] + think
    manager.add_request("a", params, prompt, [])
    word = tokenizer.encode(" hmm", add_special_tokens=False)[0]
    # Reasoning: neither masked nor forced for the first two tokens.
    for _ in range(2):
        assert torch.equal(manager.apply_bitmask(torch.zeros(1, vocab), ["a"]), torch.zeros(1, vocab))
        manager.accept("a", word)
    # Budget spent: the end marker's tokens, one per step, each the only one allowed.
    for t in end:
        out = manager.apply_bitmask(torch.zeros(1, vocab), ["a"])
        assert torch.nonzero(out[0] > -1e30)[:, 0].tolist() == [t]
        assert manager.valid_drafts("a", [word, word]) == []
        manager.accept("a", t)
    # Now the grammar: "yes" or "no" only.
    allowed = set(torch.nonzero(manager.apply_bitmask(torch.zeros(1, vocab), ["a"])[0] > -1e30)[:, 0].tolist())
    assert tokenizer.encode("yes", add_special_tokens=False)[0] in allowed and word not in allowed
    # A resumed request replays its outputs to the same place.
    manager.add_request("b", params, prompt, [word, word, *end])
    again = set(torch.nonzero(manager.apply_bitmask(torch.zeros(1, vocab), ["b"])[0] > -1e30)[:, 0].tolist())
    assert again == allowed
    # Thinking turned off in the prompt: the grammar applies from the first token.
    manager.add_request("c", params, prompt + [word] + end, [])
    assert set(torch.nonzero(manager.apply_bitmask(torch.zeros(1, vocab), ["c"])[0] > -1e30)[:, 0].tolist()) == allowed


def test_budget_without_grammar_and_requests_without_either(tokenizer):
    bounds = ReasoningBounds((7,), (9,), (9,))
    manager = StructuredOutputManager(tokenizer, 49152, {2}, bounds)
    assert manager.wants(SamplingParams(thinking_token_budget=0))
    assert not manager.wants(SamplingParams())
    assert not StructuredOutputManager(tokenizer, 49152, {2}).wants(SamplingParams(thinking_token_budget=0))
    manager.add_request("a", SamplingParams(thinking_token_budget=0), [7], [])
    out = manager.apply_bitmask(torch.zeros(2, 49152), ["x", "a"])
    assert torch.equal(out[0], torch.zeros(49152)) and torch.nonzero(out[1] > -1e30)[:, 0].tolist() == [9]


def test_budget_must_be_a_non_negative_integer():
    with pytest.raises(ValueError, match="thinking_token_budget"):
        SamplingParams(thinking_token_budget=-1)
