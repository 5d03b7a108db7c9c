"""Synthetic benchmark workloads: each sample is a prompt (token ids) and an exact output length.

Every benchmark sends these with ``ignore_eos`` so a request generates exactly ``output_len``
tokens, whatever the model would rather say; the workload, not the model, sets the lengths.

* ``random``: input and output lengths uniform around a target (``--random-range-ratio``), as
  vLLM's random dataset draws them.
* ``prefix``: a few long shared prefixes, each request one of them plus a unique suffix; what
  prefix caching is for.
* ``variable``: chat-like traffic. Prompts of 50..500 tokens, outputs from a clipped lognormal:
  most answers are short, a few run to thousands of tokens. A server that must reserve memory for
  the longest possible answer wastes most of it on this workload.
* ``grounded``: chat prompts about a passage of text whose answers copy from it (repeat, correct,
  summarise); what n-gram speculative decoding is for (pagellm.bench.grounded).

Token ids are drawn with a seeded generator from the vocabulary minus the special tokens, so a
prompt never contains an end-of-sequence or chat-control token.
"""
from __future__ import annotations

import argparse
import math
from typing import Iterable, Optional

import numpy as np

from pagellm.bench.sample_request import SampleRequest

DATASET_NAMES = ("random", "prefix", "variable", "grounded")


def allowed_token_ids(vocab_size: int, special_ids: Iterable[int]) -> np.ndarray:
    """The ids a synthetic prompt may use: all of the vocabulary except special tokens."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    mask = np.ones(vocab_size, dtype=bool)
    special = [i for i in special_ids if 0 <= i < vocab_size]
    mask[special] = False
    ids = np.flatnonzero(mask)
    if ids.size == 0:
        raise ValueError("the vocabulary has no non-special tokens to draw prompts from")
    return ids


def tokenizer_token_ids(tokenizer) -> np.ndarray:
    """``allowed_token_ids`` for a Hugging Face tokenizer, counting added special tokens too."""
    special = set(getattr(tokenizer, "all_special_ids", []))
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    special.update(i for i, tok in decoder.items() if getattr(tok, "special", False))
    return allowed_token_ids(len(tokenizer), special)


def _draw_tokens(rng: np.random.Generator, token_ids: np.ndarray, n: int) -> list[int]:
    return token_ids[rng.integers(0, token_ids.size, size=n)].tolist()


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def length_range(length: int, range_ratio: float) -> tuple[int, int]:
    """Inclusive [low, high] of lengths around ``length``, as vLLM's random dataset draws them."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"random_range_ratio must be in [0, 1), got {range_ratio}")
    low = max(1, math.floor(length * (1 - range_ratio)))
    high = max(low, math.ceil(length * (1 + range_ratio)))
    return low, high


def random_dataset(
    num_prompts: int,
    input_len: int,
    output_len: int,
    token_ids: np.ndarray,
    range_ratio: float = 0.0,
    seed: int = 0,
) -> list[SampleRequest]:
    _check_positive(num_prompts=num_prompts, input_len=input_len, output_len=output_len)
    rng = np.random.default_rng(seed)
    in_low, in_high = length_range(input_len, range_ratio)
    out_low, out_high = length_range(output_len, range_ratio)
    input_lens = rng.integers(in_low, in_high + 1, size=num_prompts)
    output_lens = rng.integers(out_low, out_high + 1, size=num_prompts)
    return [
        SampleRequest(_draw_tokens(rng, token_ids, int(n_in)), int(n_out)) for n_in, n_out in zip(input_lens, output_lens)
    ]


def prefix_dataset(
    num_prompts: int,
    prefix_len: int,
    suffix_len: int,
    num_prefixes: int,
    output_len: int,
    token_ids: np.ndarray,
    seed: int = 0,
) -> list[SampleRequest]:
    """Request ``i`` is prefix ``i % num_prefixes`` followed by its own suffix."""
    _check_positive(
        num_prompts=num_prompts, prefix_len=prefix_len, suffix_len=suffix_len, num_prefixes=num_prefixes, output_len=output_len
    )
    rng = np.random.default_rng(seed)
    prefixes = [_draw_tokens(rng, token_ids, prefix_len) for _ in range(num_prefixes)]
    return [
        SampleRequest(prefixes[i % num_prefixes] + _draw_tokens(rng, token_ids, suffix_len), output_len)
        for i in range(num_prompts)
    ]


def variable_output_lens(
    rng: np.random.Generator, num: int, output_min: int, output_max: int, output_median: float, output_sigma: float
) -> np.ndarray:
    """Lognormal output lengths clipped to [output_min, output_max]: a heavy tail of long answers."""
    if not output_min <= output_median <= output_max:
        raise ValueError(
            f"need output_min <= output_median <= output_max, got {output_min}, {output_median}, {output_max}"
        )
    if output_sigma < 0:
        raise ValueError(f"output_sigma must be non-negative, got {output_sigma}")
    lens = rng.lognormal(mean=math.log(output_median), sigma=output_sigma, size=num)
    return np.clip(np.rint(lens), output_min, output_max).astype(np.int64)


def variable_dataset(
    num_prompts: int,
    token_ids: np.ndarray,
    input_min: int = 50,
    input_max: int = 500,
    output_min: int = 10,
    output_max: int = 1500,
    output_median: float = 128.0,
    output_sigma: float = 1.2,
    seed: int = 0,
) -> list[SampleRequest]:
    _check_positive(num_prompts=num_prompts, input_min=input_min, output_min=output_min)
    if input_max < input_min or output_max < output_min:
        raise ValueError("the maximum lengths must not be below the minimum ones")
    rng = np.random.default_rng(seed)
    input_lens = rng.integers(input_min, input_max + 1, size=num_prompts)
    output_lens = variable_output_lens(rng, num_prompts, output_min, output_max, output_median, output_sigma)
    return [
        SampleRequest(_draw_tokens(rng, token_ids, int(n_in)), int(n_out)) for n_in, n_out in zip(input_lens, output_lens)
    ]


def check_fits(samples: list[SampleRequest], max_model_len: int) -> None:
    """Refuses a workload with a request that cannot run to its full length."""
    for i, s in enumerate(samples):
        if s.prompt_len + s.output_len > max_model_len:
            raise ValueError(
                f"sample {i} has {s.prompt_len} prompt + {s.output_len} output tokens, more than "
                f"max_model_len={max_model_len}; shorten the dataset lengths or raise --max-model-len"
            )


# ---- command line ---------------------------------------------------------------------


def add_dataset_args(parser: argparse.ArgumentParser, default_name: str = "random", default_num_prompts: int = 100) -> None:
    g = parser.add_argument_group("dataset")
    g.add_argument("--dataset-name", default=default_name, choices=DATASET_NAMES)
    g.add_argument("--num-prompts", type=int, default=default_num_prompts)
    g.add_argument("--input-len", type=int, default=None, help="shorthand for --random-input-len")
    g.add_argument("--output-len", type=int, default=None, help="output length of random and prefix samples")
    g.add_argument("--random-input-len", type=int, default=1024)
    g.add_argument("--random-output-len", type=int, default=128)
    g.add_argument("--random-range-ratio", type=float, default=0.0, help="lengths drawn uniformly in len*(1 -+ ratio)")
    g.add_argument("--prefix-len", type=int, default=512)
    g.add_argument("--suffix-len", type=int, default=64)
    g.add_argument("--num-prefixes", type=int, default=4)
    g.add_argument("--variable-input-min", type=int, default=50)
    g.add_argument("--variable-input-max", type=int, default=500)
    g.add_argument("--variable-output-min", type=int, default=10)
    g.add_argument("--variable-output-max", type=int, default=1500)
    g.add_argument("--variable-output-median", type=float, default=128.0)
    g.add_argument("--variable-output-sigma", type=float, default=1.2, help="lognormal sigma of output lengths")


def get_samples(args: argparse.Namespace, token_ids: np.ndarray, seed: Optional[int] = None, tokenizer=None) -> list[SampleRequest]:
    """The dataset the parsed ``add_dataset_args`` flags describe (``grounded`` needs the tokenizer)."""
    seed = args.seed if seed is None else seed
    if args.dataset_name == "grounded":
        from pagellm.bench.grounded import grounded_dataset

        if tokenizer is None:
            raise ValueError("the grounded dataset needs a tokenizer")
        return grounded_dataset(
            args.num_prompts, args.input_len or args.random_input_len, args.output_len or args.random_output_len, tokenizer, seed
        )
    if args.dataset_name == "random":
        return random_dataset(
            args.num_prompts,
            args.input_len or args.random_input_len,
            args.output_len or args.random_output_len,
            token_ids,
            args.random_range_ratio,
            seed,
        )
    if args.dataset_name == "prefix":
        return prefix_dataset(
            args.num_prompts,
            args.prefix_len,
            args.suffix_len,
            args.num_prefixes,
            args.output_len or 64,
            token_ids,
            seed,
        )
    if args.dataset_name == "variable":
        return variable_dataset(
            args.num_prompts,
            token_ids,
            args.variable_input_min,
            args.variable_input_max,
            args.variable_output_min,
            args.variable_output_max,
            args.variable_output_median,
            args.variable_output_sigma,
            seed,
        )
    raise ValueError(f"unknown dataset {args.dataset_name!r}; choose one of {DATASET_NAMES}")
