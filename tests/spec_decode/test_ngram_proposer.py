"""N-gram prompt lookup: exact drafts for hand-made token sequences."""
from __future__ import annotations

import numpy as np
import pytest

from pagellm.spec_decode.ngram_proposer import NgramProposer
from pagellm.speculative_config import SpeculativeConfig


def propose(tokens: list[int], k: int, lo: int = 1, hi: int = 3) -> list[int]:
    return NgramProposer(lo, hi).propose(np.array(tokens, dtype=np.int64), k)


def test_copies_what_followed_the_last_ngram():
    #        0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 9, 1, 2, 5, 6, 7]
    assert propose(tokens, 3) == [8, 9, 1]
    assert propose(tokens, 10) == [8, 9, 1, 2, 5, 6, 7]  # runs up to the end of the sequence


def test_longest_ngram_first_then_most_recent_occurrence():
    # "7" alone last occurred at 5 (followed by 3); "6 7" occurred at 1-2 (followed by 4).
    tokens = [6, 7, 4, 4, 9, 7, 3, 6, 7]
    assert propose(tokens, 2, lo=1, hi=2) == [4, 4]
    assert propose(tokens, 2, lo=1, hi=1) == [3, 6]
    # The most recent of two equal-length matches wins.
    assert propose([1, 2, 9, 1, 2, 8, 1, 2], 1, lo=2, hi=2) == [8]


def test_no_draft_without_a_match_of_at_least_min_length():
    assert propose([1, 2, 3, 4, 5], 4) == []
    assert propose([1, 2, 3, 9, 3], 4, lo=2, hi=3) == []  # "3" recurs, but no 2-gram does
    assert propose([4], 4) == []
    assert propose([4, 4, 4], 0) == []


def test_config_defaults_and_refusals():
    config = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}')
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (3, 3)
    config = SpeculativeConfig.parse({"method": "[ngram]", "num_speculative_tokens": 2})
    assert (config.method, config.prompt_lookup_min, config.prompt_lookup_max) == ("ngram", 5, 5)
    assert SpeculativeConfig.parse({"model": "/m", "num_speculative_tokens": 2}).method == "draft_model"
    assert NgramProposer.from_config(config).prompt_lookup_max == 5
    assert NgramProposer.from_config(None) is None
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig.parse({"method": "ngram"})
    with pytest.raises(ValueError, match="must not exceed"):
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2})
    with pytest.raises(ValueError, match="unsupported speculative method"):
        SpeculativeConfig.parse({"method": "eagle", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="unsupported speculative_config keys"):
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "typo": 1})
    with pytest.raises(ValueError, match="not valid JSON"):
        SpeculativeConfig.parse("{method: ngram}")


def _naive(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_matches_a_naive_search_on_random_sequences():
    rng = np.random.default_rng(0)
    for _ in range(500):
        tokens = rng.integers(0, 4, int(rng.integers(1, 40))).tolist()
        lo = int(rng.integers(1, 4))
        hi = lo + int(rng.integers(0, 3))
        k = int(rng.integers(1, 6))
        assert propose(tokens, k, lo, hi) == _naive(tokens, k, lo, hi), (tokens, k, lo, hi)
