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

from pagellm.kernels import ops
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


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the token at which ``probs``' CDF (unnormalised) passes ``u`` of its total."""
    cdf = probs.cumsum(dim=-1)
    targets = (u * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, targets, right=True).squeeze(1).clamp_max_(probs.shape[-1] - 1)


class RejectionSampler:
    def __init__(self, sampler: Optional[Sampler] = None) -> None:
        self.sampler = sampler if sampler is not None else Sampler()

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata, spec: SpecDecodeMetadata) -> RejectionOutput:
        if logits.dim() != 2 or logits.shape[0] != spec.num_rows:
            raise ValueError(f"{spec.num_rows} verification rows expected, got logits of shape {tuple(logits.shape)}")
        device = logits.device
        # Only probs() edits the logits in place, so an all-greedy step reads the caller's rows.
        logits, raw_logprobs = self.sampler.prepare_logits(logits, metadata, copy=not metadata.all_greedy)
        greedy_mask = metadata.greedy_mask.tolist()
        target_argmax = ops.argmax_rows(logits).tolist()
        probs: Optional[torch.Tensor] = None
        u: Optional[torch.Tensor] = None
        if not metadata.all_greedy:
            probs = self.sampler.probs(logits, metadata)
            # Two draws a row: the acceptance test, then the residual (or bonus) sample.
            u = self.sampler.uniforms(logits.shape[0], metadata.seeds, device, num_draws=2)
        starts = spec.row_starts
        # Every draft's acceptance test at once: draft rows are all rows but each request's last.
        draft_rows = [start + j for start, drafts in zip(starts, spec.draft_token_ids) for j in range(len(drafts))]
        draft_ids = [d for drafts in spec.draft_token_ids for d in drafts]
        accepted = [False] * len(draft_rows)
        if draft_rows:
            rows_t = torch.tensor(draft_rows, dtype=torch.int64, device=device)
            ids_t = torch.tensor(draft_ids, dtype=torch.int64, device=device)
            greedy_ok = torch.tensor([target_argmax[r] for r in draft_rows], device=device) == ids_t
            if probs is None:
                accepted = greedy_ok.tolist()
            else:
                p_draft = probs[rows_t, ids_t]
                q_draft = self._draft_probs_at(spec, p_draft)
                random_ok = (q_draft > 0) & (u[rows_t, 0] * q_draft < p_draft)
                greedy_rows = metadata.greedy_mask.to(device)[rows_t]
                accepted = torch.where(greedy_rows, greedy_ok, random_ok).tolist()

        outputs: list[list[int]] = []
        row_tokens = list(target_argmax)  # the token each row's logprobs report
        resample: list[tuple[int, int, int, int]] = []  # (request, row, rejected draft or -1, draft index)
        k = 0
        for i, (start, drafts) in enumerate(zip(starts, spec.draft_token_ids)):
            tokens: list[int] = []
            stop = len(drafts)
            for j, draft in enumerate(drafts):
                if not accepted[k + j]:
                    stop = j
                    break
                tokens.append(draft)
                row_tokens[start + j] = draft
            k += len(drafts)
            row = start + stop
            if greedy_mask[row]:
                tokens.append(target_argmax[row])
            else:
                resample.append((i, row, drafts[stop] if stop < len(drafts) else -1, stop))
                tokens.append(-1)  # filled in below
            outputs.append(tokens)
        if resample:
            rows_t = torch.tensor([r for _, r, _, _ in resample], dtype=torch.int64, device=device)
            dist = probs[rows_t].clone()
            for n, (i, _, draft, j) in enumerate(resample):
                if draft < 0:
                    continue  # every draft accepted: the bonus token comes from p itself
                q = spec.draft_probs[i] if spec.draft_probs is not None else None
                if q is not None:
                    dist[n].sub_(q[j].to(dist.dtype)).clamp_(min=0.0)
                else:
                    dist[n, draft] = 0.0
            # p == q everywhere cannot reject; float round-off all the same falls back to p.
            empty = dist.sum(dim=-1) <= 0
            if bool(empty.any()):
                dist[empty] = probs[rows_t[empty]]
            tokens_t = _inverse_cdf(dist, u[rows_t, 1]).tolist()
            for (i, row, _, _), token in zip(resample, tokens_t):
                outputs[i][-1] = token
                row_tokens[row] = token

        logprobs = None
        if raw_logprobs is not None:
            chosen = torch.tensor(row_tokens, dtype=torch.int64, device=raw_logprobs.device)
            logprobs = gather_logprobs(raw_logprobs, metadata.max_num_logprobs, chosen)
        return RejectionOutput(outputs, logprobs)

    @staticmethod
    def _draft_probs_at(spec: SpecDecodeMetadata, like: torch.Tensor) -> torch.Tensor:
        """q(d) for every draft in order: 1 for point-mass drafts."""
        if spec.draft_probs is None:
            return torch.ones_like(like)
        values = []
        for probs, drafts in zip(spec.draft_probs, spec.draft_token_ids):
            if probs is None:
                values.extend([1.0] * len(drafts))
            else:
                values.extend(probs[torch.arange(len(drafts)), torch.tensor(drafts)].tolist())
        return torch.tensor(values, dtype=like.dtype, device=like.device)
