"""Logit processors that run before greedy/random selection: logit bias, banned tokens, penalties.

All of them may change the argmax, so they apply to greedy rows too. Each works in place on a
float32 ``[B, V]`` logits tensor that the sampler owns (never the model's own output buffer).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch


def _check_token_ids(token_ids: Sequence[int], vocab_size: int, what: str) -> None:
    for t in token_ids:
        if not 0 <= t < vocab_size:
            raise ValueError(f"{what} token id {t} is outside the vocabulary [0, {vocab_size}).")


def apply_logit_bias(logits: torch.Tensor, logit_bias: dict[int, dict[int, float]]) -> None:
    """Adds ``logit_bias[row][token]`` to ``logits[row, token]``, in place, with one scatter."""
    if not logit_bias:
        return
    num_rows, vocab_size = logits.shape
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for row, bias in logit_bias.items():
        if not 0 <= row < num_rows:
            raise ValueError(f"logit_bias row {row} is outside the batch of {num_rows} rows.")
        _check_token_ids(bias.keys(), vocab_size, "logit_bias")
        rows.extend([row] * len(bias))
        cols.extend(bias.keys())
        values.extend(bias.values())
    if not rows:
        return
    device = logits.device
    index = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))
    logits.index_put_(index, torch.tensor(values, dtype=logits.dtype, device=device), accumulate=True)


def apply_bad_token_ids(logits: torch.Tensor, bad_token_ids: dict[int, list[int]]) -> None:
    """Sets forbidden tokens (e.g. EOS below ``min_tokens``) to -inf, in place."""
    if not bad_token_ids:
        return
    num_rows, vocab_size = logits.shape
    rows: list[int] = []
    cols: list[int] = []
    for row, token_ids in bad_token_ids.items():
        if not 0 <= row < num_rows:
            raise ValueError(f"bad_token_ids row {row} is outside the batch of {num_rows} rows.")
        _check_token_ids(token_ids, vocab_size, "bad_token_ids")
        rows.extend([row] * len(token_ids))
        cols.extend(token_ids)
    if not rows:
        return
    device = logits.device
    logits[torch.tensor(rows, device=device), torch.tensor(cols, device=device)] = float("-inf")


def pad_token_ids(token_ids: list[list[int]], pad_id: int, device: torch.device) -> torch.Tensor:
    """Right-pads ragged per-row token lists into an int64 ``[B, max_len]`` tensor."""
    max_len = max((len(ids) for ids in token_ids), default=0)
    padded = [ids + [pad_id] * (max_len - len(ids)) for ids in token_ids]
    return torch.tensor(padded, dtype=torch.int64).reshape(len(token_ids), max_len).to(device)


def token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Per-row occurrence counts ``[B, V]`` (float32) of an int ``[B, L]`` tensor.

    Ids outside ``[0, V)`` are padding: they land in an extra bin that is then dropped, so any
    pad value works.
    """
    num_rows = token_ids.shape[0]
    ids = token_ids.to(torch.int64)
    ids = torch.where((ids < 0) | (ids >= vocab_size), vocab_size, ids)
    counts = torch.zeros(num_rows, vocab_size + 1, dtype=torch.float32, device=token_ids.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab_size]


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: Optional[torch.Tensor],
    output_token_ids: list[list[int]],
    presence_penalties: Optional[torch.Tensor],
    frequency_penalties: Optional[torch.Tensor],
    repetition_penalties: Optional[torch.Tensor],
) -> torch.Tensor:
    """Applies repetition, frequency and presence penalties, vectorized over the batch.

    Repetition (HF / vLLM): for tokens seen in the prompt or the output, positive logits are
    divided by the penalty and negative ones multiplied, so a penalty > 1 always lowers them.
    Frequency subtracts ``penalty * count`` and presence ``penalty * [count > 0]``, both counted
    over output tokens only (OpenAI semantics).
    """
    num_rows, vocab_size = logits.shape
    if len(output_token_ids) != num_rows:
        raise ValueError(f"output_token_ids has {len(output_token_ids)} rows, logits have {num_rows}.")
    output_counts = token_counts(pad_token_ids(output_token_ids, vocab_size, logits.device), vocab_size)
    output_mask = output_counts > 0
    if repetition_penalties is not None:
        seen = output_mask
        if prompt_token_ids is not None:
            if prompt_token_ids.shape[0] != num_rows:
                raise ValueError(f"prompt_token_ids has {prompt_token_ids.shape[0]} rows, logits have {num_rows}.")
            seen = seen | (token_counts(prompt_token_ids, vocab_size) > 0)
        penalty = repetition_penalties.to(logits.dtype).unsqueeze(1)
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalized, logits)
    if frequency_penalties is not None:
        logits -= frequency_penalties.to(logits.dtype).unsqueeze(1) * output_counts
    if presence_penalties is not None:
        logits -= presence_penalties.to(logits.dtype).unsqueeze(1) * output_mask.to(logits.dtype)
    return logits
