"""Top-k logprobs plus the chosen token's own logprob and rank, for samples and prompts.

Logprobs are those of the model's raw distribution (log_softmax of the unprocessed logits),
which is vLLM's default: penalties, temperature and truncation do not show in them.
"""
from __future__ import annotations

import torch

from pagellm.sample.metadata import LogprobsTensors

# Prompt logprobs need a log_softmax over [N, V]; chunking the rows bounds the temporary to
# about this many float32 elements (128 MiB) however long the prompt is.
_PROMPT_CHUNK_ELEMENTS = 32 * 1024 * 1024


def gather_logprobs(logprobs: torch.Tensor, num_logprobs: int, token_ids: torch.Tensor) -> LogprobsTensors:
    """Packs ``token_ids``' logprobs (column 0) with the top ``num_logprobs`` of each row.

    The rank of a token is the number of tokens at least as likely as it, so the most likely
    token has rank 1 and ties share the worse rank.
    """
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [N, V], got shape {tuple(logprobs.shape)}.")
    num_rows, vocab_size = logprobs.shape
    if token_ids.shape != (num_rows,):
        raise ValueError(f"token_ids must have shape ({num_rows},), got {tuple(token_ids.shape)}.")
    if not 0 <= num_logprobs <= vocab_size:
        raise ValueError(f"num_logprobs must be in [0, {vocab_size}], got {num_logprobs}.")
    token_ids = token_ids.to(device=logprobs.device, dtype=torch.int64).unsqueeze(1)
    top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)
    token_logprobs = logprobs.gather(1, token_ids)
    ranks = (logprobs >= token_logprobs).sum(dim=-1)
    return LogprobsTensors(
        token_ids=torch.cat((token_ids, top_ids), dim=1),
        logprobs=torch.cat((token_logprobs, top_logprobs), dim=1),
        ranks=ranks,
    )


def compute_prompt_logprobs(logits: torch.Tensor, target_token_ids: torch.Tensor, num_logprobs: int) -> LogprobsTensors:
    """Logprobs of each prompt token given its prefix: row i of ``logits`` predicts target i.

    Processes the rows in chunks so long prompts do not materialize a full [N, V] log_softmax.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}.")
    num_rows, vocab_size = logits.shape
    if target_token_ids.shape != (num_rows,):
        raise ValueError(f"target_token_ids must have shape ({num_rows},), got {tuple(target_token_ids.shape)}.")
    chunk = max(1, _PROMPT_CHUNK_ELEMENTS // max(vocab_size, 1))
    parts = [
        gather_logprobs(
            torch.log_softmax(logits[start : start + chunk].to(torch.float32), dim=-1),
            num_logprobs,
            target_token_ids[start : start + chunk],
        )
        for start in range(0, num_rows, chunk)
    ]
    if len(parts) == 1:
        return parts[0]
    if not parts:
        device = logits.device
        return LogprobsTensors(
            token_ids=torch.empty(0, num_logprobs + 1, dtype=torch.int64, device=device),
            logprobs=torch.empty(0, num_logprobs + 1, dtype=torch.float32, device=device),
            ranks=torch.empty(0, dtype=torch.int64, device=device),
        )
    return LogprobsTensors(
        token_ids=torch.cat([p.token_ids for p in parts]),
        logprobs=torch.cat([p.logprobs for p in parts]),
        ranks=torch.cat([p.ranks for p in parts]),
    )
