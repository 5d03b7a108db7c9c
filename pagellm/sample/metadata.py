"""The narrow objects that cross the model-runner / sampler boundary."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class SamplingMetadata:
    """Per-row sampling settings for one step; row i is the i-th sequence that samples this step.

    Tensors are on the logits' device, float32 unless noted. Rows that need no such
    processing carry the neutral value (temperature 1 for greedy rows is never used since
    ``greedy_mask`` picks argmax for them).
    """

    temperature: torch.Tensor  # [B]
    greedy_mask: torch.Tensor  # bool [B]
    all_greedy: bool
    all_random: bool
    top_p: Optional[torch.Tensor]  # [B] or None when every row is 1.0
    top_k: Optional[torch.Tensor]  # int64 [B] or None when every row is 0 (disabled); 0 -> no limit
    min_p: Optional[torch.Tensor]  # [B] or None when every row is 0.0
    # Per-row seeded generation: row -> (seed, number of tokens already generated).
    # A row's random draw for its k-th output token depends only on (seed, k), so a seeded
    # request gives the same output whatever shares its batch and across preemption.
    seeds: dict[int, tuple[int, int]]
    # Penalties; None when no row uses any.
    presence_penalties: Optional[torch.Tensor]  # [B]
    frequency_penalties: Optional[torch.Tensor]  # [B]
    repetition_penalties: Optional[torch.Tensor]  # [B]
    output_token_ids: list[list[int]]  # per row, tokens generated so far (for penalties)
    prompt_token_ids: Optional[torch.Tensor]  # int64 [B, max_prompt_len] padded with vocab_size, or None
    # Tokens forbidden this step per row (stop/EOS tokens while below min_tokens).
    bad_token_ids: dict[int, list[int]]
    logit_bias: dict[int, dict[int, float]]  # row -> {token_id: bias}
    max_num_logprobs: Optional[int]  # max over rows of `logprobs`; None when no row wants any


@dataclass
class LogprobsTensors:
    """Top-k logprobs plus the chosen token's own, for each row."""

    token_ids: torch.Tensor  # int64 [B, k + 1]; column 0 is the sampled (or actual prompt) token
    logprobs: torch.Tensor  # float32 [B, k + 1]
    ranks: torch.Tensor  # int64 [B]: rank of column 0's token (1 = most likely)


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # int64 [B]
    logprobs: Optional[LogprobsTensors]  # None when max_num_logprobs is None
