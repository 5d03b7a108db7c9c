import argparse

import numpy as np
import pytest

from pagellm.bench.datasets import (
    SampleRequest,
    add_dataset_args,
    allowed_token_ids,
    check_fits,
    get_samples,
    length_range,
    prefix_dataset,
    random_dataset,
    variable_dataset,
)

SPECIAL = [0, 1, 2, 7]
TOKEN_IDS = allowed_token_ids(50, SPECIAL)


def test_allowed_token_ids_excludes_special_tokens():
    assert TOKEN_IDS.tolist() == [i for i in range(50) if i not in SPECIAL]
    assert allowed_token_ids(3, [5]).tolist() == [0, 1, 2]  # out-of-range specials are ignored
    with pytest.raises(ValueError):
        allowed_token_ids(2, [0, 1])


def test_length_range_matches_vllm_rounding():
    assert length_range(100, 0.0) == (100, 100)
    assert length_range(100, 0.25) == (75, 125)
    assert length_range(10, 0.55) == (4, 16)  # floor(4.5), ceil(15.5)
    assert length_range(1, 0.9) == (1, 2)
    with pytest.raises(ValueError):
        length_range(10, 1.0)


def test_random_dataset_exact_lengths_without_range():
    samples = random_dataset(5, input_len=12, output_len=7, token_ids=TOKEN_IDS, seed=3)
    assert len(samples) == 5
    assert all(s.prompt_len == 12 and s.output_len == 7 for s in samples)
    assert all(set(s.prompt_token_ids) <= set(TOKEN_IDS.tolist()) for s in samples)


def test_random_dataset_range_and_determinism():
    a = random_dataset(200, 40, 20, TOKEN_IDS, range_ratio=0.5, seed=1)
    b = random_dataset(200, 40, 20, TOKEN_IDS, range_ratio=0.5, seed=1)
    c = random_dataset(200, 40, 20, TOKEN_IDS, range_ratio=0.5, seed=2)
    assert a == b
    assert a != c
    in_lens = [s.prompt_len for s in a]
    out_lens = [s.output_len for s in a]
    assert min(in_lens) >= 20 and max(in_lens) <= 60
    assert min(out_lens) >= 10 and max(out_lens) <= 30
    assert len(set(in_lens)) > 10  # actually spread over the range


def test_no_special_tokens_in_any_dataset():
    special = set(SPECIAL)
    samples = (
        random_dataset(20, 30, 5, TOKEN_IDS, seed=0)
        + prefix_dataset(8, 20, 5, 2, 4, TOKEN_IDS, seed=0)
        + variable_dataset(20, TOKEN_IDS, 5, 30, 1, 50, 10, seed=0)
    )
    assert all(not special & set(s.prompt_token_ids) for s in samples)


def test_prefix_dataset_shares_prefixes_round_robin():
    samples = prefix_dataset(7, prefix_len=16, suffix_len=4, num_prefixes=3, output_len=5, token_ids=TOKEN_IDS, seed=0)
    assert all(s.prompt_len == 20 and s.output_len == 5 for s in samples)
    prefixes = [tuple(s.prompt_token_ids[:16]) for s in samples]
    assert len(set(prefixes)) == 3
    for i, p in enumerate(prefixes):
        assert p == prefixes[i % 3]
    suffixes = [tuple(s.prompt_token_ids[16:]) for s in samples]
    assert len(set(suffixes)) == 7  # every suffix is the request's own
    assert samples == prefix_dataset(7, 16, 4, 3, 5, TOKEN_IDS, seed=0)


def test_variable_dataset_is_heavy_tailed_and_clipped():
    samples = variable_dataset(
        2000, TOKEN_IDS, input_min=50, input_max=500, output_min=10, output_max=2000, output_median=128, output_sigma=1.2, seed=0
    )
    in_lens = np.array([s.prompt_len for s in samples])
    out_lens = np.array([s.output_len for s in samples])
    assert in_lens.min() >= 50 and in_lens.max() <= 500
    assert out_lens.min() >= 10 and out_lens.max() <= 2000
    assert out_lens.min() == 10 and out_lens.max() == 2000  # both clips are reached with this many samples
    # Most outputs are short, a few very long: median near 128, mean well above it.
    assert 100 <= np.median(out_lens) <= 160
    assert out_lens.mean() > 1.5 * np.median(out_lens)
    assert np.mean(out_lens > 1000) < 0.1
    assert samples == variable_dataset(2000, TOKEN_IDS, 50, 500, 10, 2000, 128, 1.2, seed=0)


@pytest.mark.parametrize(
    "kwargs",
    [dict(output_median=5), dict(output_median=3000), dict(output_sigma=-1), dict(input_min=10, input_max=5)],
)
def test_variable_dataset_rejects_bad_lengths(kwargs):
    base = dict(input_min=5, input_max=10, output_min=10, output_max=100, output_median=20, output_sigma=1.0)
    base.update(kwargs)
    with pytest.raises(ValueError):
        variable_dataset(4, TOKEN_IDS, **base)


def test_bad_counts_are_value_errors():
    with pytest.raises(ValueError, match="num_prompts"):
        random_dataset(0, 10, 10, TOKEN_IDS)
    with pytest.raises(ValueError, match="prefix_len"):
        prefix_dataset(4, 0, 4, 1, 4, TOKEN_IDS)


def test_check_fits():
    check_fits([SampleRequest([1] * 10, 6)], max_model_len=16)
    with pytest.raises(ValueError, match="max_model_len=15"):
        check_fits([SampleRequest([1] * 10, 6)], max_model_len=15)


def test_get_samples_from_flags():
    parser = argparse.ArgumentParser()
    add_dataset_args(parser)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(["--dataset-name", "prefix", "--num-prompts", "6", "--prefix-len", "8", "--suffix-len", "2",
                              "--num-prefixes", "2", "--output-len", "3"])
    samples = get_samples(args, TOKEN_IDS)
    assert len(samples) == 6 and all(s.prompt_len == 10 and s.output_len == 3 for s in samples)
    args = parser.parse_args(["--num-prompts", "3", "--input-len", "9", "--random-output-len", "4"])
    assert all(s.prompt_len == 9 and s.output_len == 4 for s in get_samples(args, TOKEN_IDS))
    args = parser.parse_args(["--dataset-name", "variable", "--num-prompts", "5", "--variable-input-min", "3",
                              "--variable-input-max", "3", "--variable-output-min", "2", "--variable-output-max", "9",
                              "--variable-output-median", "4"])
    samples = get_samples(args, TOKEN_IDS)
    assert all(s.prompt_len == 3 and 2 <= s.output_len <= 9 for s in samples)
