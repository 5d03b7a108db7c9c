"""Verifies drafted tokens against the target model's distributions, keeping them exactly.

Each verifying request brings k drafts and k + 1 rows of target logits: row j is the target's
distribution after the drafts before it. Greedy rows accept a draft while it is the argmax.
Random rows use speculative sampling (Leviathan et al., 2023): draft ``d`` drawn from ``q`` is
accepted with probability ``min(1, p(d) / q(d))``; at the first rejection the token comes from
the residual ``max(p - q, 0)`` renormalised, and when every draft is accepted one more comes from
the last row's ``p``. Each output token then follows ``p`` exactly. An n-gram draft is a point
mass (``q(d) = 1``), so it is accepted with probability ``p(d)`` and its residual is ``p``
without ``d``.

``p`` is what the plain sampler draws from (bias, bans, penalties, temperature, top-k, top-p,
min-p, each row's grammar), so the caller builds every row's ``SamplingMetadata`` as if the
drafts before it had been sampled.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from pagellm.sample.logprobs import gather_logprobs
from pagellm.sample.metadata import LogprobsTensors, SamplingMetadata
from pagellm.sample.sampler import Sampler


@dataclass
class SpecDecodeMetadata:
    """The drafts of one step: request i owns rows ``row_starts[i] .. row_starts[i] + k_i``."""

    draft_token_ids: list[list[int]]  # per request, k_i >= 0 drafts
    # Per request, the draft model's distributions ``[k_i, V]`` its drafts were drawn from, or
    # None for drafts that are point masses (n-gram lookup, or a greedy draft model).
    draft_probs: Optional[list[Optional[torch.Tensor]]] = None

    @property
    def num_rows(self) -> int:
        return sum(len(d) + 1 for d in self.draft_token_ids)

    @property
    def row_starts(self) -> list[int]:
        starts, n = [], 0
        for drafts in self.draft_token_ids:
            starts.append(n)
            n += len(drafts) + 1
        return starts


@dataclass
class RejectionOutput:
    output_token_ids: list[list[int]]  # per request, the accepted drafts and one more token
    # Logprobs of every row (for the token the row output, or its draft where it accepted);
    # None when no row wants logprobs.
    logprobs: Optional[LogprobsTensors]


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> int:
    """The token at which ``probs``' CDF (unnormalised) passes ``u`` of its total."""
    cdf = probs.cumsum(dim=-1)
    target = u * cdf[-1]
    return int(torch.searchsorted(cdf, target.reshape(1), right=True).clamp_max_(probs.shape[-1] - 1))


class RejectionSampler:
    def __init__(self, sampler: Optional[Sampler] = None) -> None:
        self.sampler = sampler if sampler is not None else Sampler()

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata, spec: SpecDecodeMetadata) -> RejectionOutput:
        if logits.dim() != 2 or logits.shape[0] != spec.num_rows:
            raise ValueError(f"{spec.num_rows} verification rows expected, got logits of shape {tuple(logits.shape)}")
        logits, raw_logprobs = self.sampler.prepare_logits(logits, metadata)
        greedy_mask = metadata.greedy_mask.tolist()
        target_argmax = logits.argmax(dim=-1).tolist()
        probs: Optional[torch.Tensor] = None
        if not metadata.all_greedy:
            probs = self.sampler.probs(logits, metadata)
        # Two draws a row: the acceptance test, then the residual (or bonus) sample.
        u = self.sampler.uniforms(logits.shape[0], metadata.seeds, logits.device, num_draws=2).tolist()

        outputs: list[list[int]] = []
        row_tokens = list(target_argmax)  # the token each row's logprobs report
        for i, (start, drafts) in enumerate(zip(spec.row_starts, spec.draft_token_ids)):
            q = spec.draft_probs[i] if spec.draft_probs is not None else None
            tokens: list[int] = []
            for j, draft in enumerate(drafts):
                row = start + j
                if greedy_mask[row]:
                    accepted = target_argmax[row] == draft
                else:
                    p_draft = float(probs[row, draft])
                    q_draft = float(q[j, draft]) if q is not None else 1.0
                    accepted = q_draft > 0.0 and u[row][0] * q_draft < p_draft
                if accepted:
                    tokens.append(draft)
                    row_tokens[row] = draft
                    continue
                if greedy_mask[row]:
                    token = target_argmax[row]
                else:
                    residual = probs[row].clone()
                    if q is not None:
                        residual.sub_(q[j].to(residual.dtype)).clamp_(min=0.0)
                    else:
                        residual[draft] = 0.0
                    # p == q at every token cannot reject; guard float round-off all the same.
                    token = _inverse_cdf(residual if float(residual.sum()) > 0.0 else probs[row], torch.tensor(u[row][1]))
                tokens.append(token)
                row_tokens[row] = token
                break
            else:
                row = start + len(drafts)
                token = target_argmax[row] if greedy_mask[row] else _inverse_cdf(probs[row], torch.tensor(u[row][1]))
                tokens.append(token)
                row_tokens[row] = token
            outputs.append(tokens)

        logprobs = None
        if raw_logprobs is not None:
            chosen = torch.tensor(row_tokens, dtype=torch.int64, device=raw_logprobs.device)
            logprobs = gather_logprobs(raw_logprobs, metadata.max_num_logprobs, chosen)
        return RejectionOutput(outputs, logprobs)
