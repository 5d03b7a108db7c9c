"""The sampler's per-row settings for one step, gathered from the runner's persistent batch."""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from pagellm.sample.metadata import SamplingMetadata
from pagellm.worker.input_batch import InputBatch


def build_sampling_metadata(
    batch: InputBatch,
    rows: np.ndarray,
    device: torch.device,
    vocab_size: int,
    draft_prefixes: Optional[list[list[int]]] = None,
) -> SamplingMetadata:
    """Metadata for sampling rows ``rows`` of ``batch`` (a row may repeat).

    ``draft_prefixes[i]``: drafts that precede sampling row i (speculative decoding verifies a
    request's k drafts in k + 1 rows); penalties, min_tokens and seeds then treat them as already
    sampled, which is what the row would have seen had they been.
    """
    params = [batch.params[r] for r in rows.tolist()]
    greedy = batch.greedy[rows]

    def tensor(arr: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(arr)).to(device)

    def num_drafts(i: int) -> int:
        return len(draft_prefixes[i]) if draft_prefixes is not None else 0

    top_p, top_k, min_p = batch.top_p[rows], batch.top_k[rows], batch.min_p[rows]
    presence, frequency = batch.presence_penalty[rows], batch.frequency_penalty[rows]
    repetition = batch.repetition_penalty[rows]
    use_penalties = bool(presence.any() or frequency.any() or (repetition != 1.0).any())
    output_token_ids: list[list[int]] = []
    prompt_token_ids: Optional[torch.Tensor] = None
    if use_penalties:
        output_token_ids = [batch.output_token_ids(r) for r in rows.tolist()]
        if draft_prefixes is not None:
            output_token_ids = [out + prefix for out, prefix in zip(output_token_ids, draft_prefixes)]
        max_prompt = int(batch.num_prompt_tokens[rows].max())
        prompts = np.full((len(rows), max_prompt), vocab_size, dtype=np.int64)
        for i, r in enumerate(rows.tolist()):
            n = int(batch.num_prompt_tokens[r])
            prompts[i, :n] = batch.token_ids[r, :n]
        prompt_token_ids = tensor(prompts)
    seeds: dict[int, tuple[int, int]] = {}
    bad_token_ids: dict[int, list[int]] = {}
    logit_bias: dict[int, dict[int, float]] = {}
    wanted_logprobs = [p.logprobs for p in params if p.logprobs is not None]
    for i, (p, r) in enumerate(zip(params, rows.tolist())):
        num_out = batch.num_output_tokens(r) + num_drafts(i)
        if p.seed is not None and not greedy[i]:
            seeds[i] = (p.seed, num_out)
        if num_out < p.min_tokens and p.all_stop_token_ids:
            bad_token_ids[i] = sorted(p.all_stop_token_ids)
        if p.logit_bias:
            logit_bias[i] = p.logit_bias
    return SamplingMetadata(
        temperature=tensor(batch.temperature[rows]),
        greedy_mask=tensor(greedy),
        all_greedy=bool(greedy.all()),
        all_random=not bool(greedy.any()),
        top_p=tensor(top_p) if (top_p < 1.0).any() else None,
        top_k=tensor(top_k) if (top_k > 0).any() else None,
        min_p=tensor(min_p) if (min_p > 0.0).any() else None,
        seeds=seeds,
        presence_penalties=tensor(presence) if use_penalties else None,
        frequency_penalties=tensor(frequency) if use_penalties else None,
        repetition_penalties=tensor(repetition) if use_penalties else None,
        output_token_ids=output_token_ids,
        prompt_token_ids=prompt_token_ids,
        bad_token_ids=bad_token_ids,
        logit_bias=logit_bias,
        max_num_logprobs=max(wanted_logprobs) if wanted_logprobs else None,
    )
