"""Truncation of the distribution for random sampling: top-k, top-p (nucleus) and min-p.

These never change the argmax, so they only run for random rows, after temperature. Masked
tokens get -inf logits. Each function works in place on a ``[B, V]`` float tensor and returns it.
"""
from __future__ import annotations

from typing import Optional

import torch


def _effective_top_k(top_k: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Per-row k as int64, with disabled rows (k <= 0) and k >= V mapped to V (keep all)."""
    k = top_k.to(torch.int64)
    return torch.where((k <= 0) | (k > vocab_size), vocab_size, k)


def apply_top_k_only(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keeps exactly the k largest logits of each row using ``topk`` over the largest k only.

    A full sort costs O(V log V) per row; ``topk`` with the batch's largest active k is much
    cheaper when k is small, which is the common case.
    """
    vocab_size = logits.shape[1]
    k = _effective_top_k(top_k, vocab_size)
    active = k < vocab_size
    # One host sync: topk needs a Python int.
    max_k = int(torch.where(active, k, 0).max())
    if max_k == 0:
        return logits
    top_idx = logits.topk(max_k, dim=-1, sorted=True).indices
    positions = torch.arange(max_k, device=logits.device)
    keep_top = positions.unsqueeze(0) < k.unsqueeze(1)
    keep = torch.zeros_like(logits, dtype=torch.bool)
    keep.scatter_(1, top_idx, keep_top)
    keep |= ~active.unsqueeze(1)
    return logits.masked_fill_(~keep, float("-inf"))


# Top-p looks for the nucleus among this many most likely tokens first; a nucleus is almost
# always far smaller, and a full sort of the vocabulary per row is slow on a CPU (docs/kernels.md).
NUCLEUS_CANDIDATES = 1024


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: Optional[torch.Tensor], top_p: Optional[torch.Tensor]
) -> torch.Tensor:
    """Applies top-k then top-p, exactly, looking at the top candidates before sorting anything.

    Rows whose nucleus (or top-k set) lies within the ``NUCLEUS_CANDIDATES`` most likely tokens
    are done with one ``topk``; the rest fall back to a full sort.
    """
    if top_p is None or top_k is None and logits.shape[1] <= NUCLEUS_CANDIDATES:
        return _apply_top_k_top_p_sorted(logits, top_k, top_p)
    vocab_size = logits.shape[1]
    k = _effective_top_k(top_k, vocab_size) if top_k is not None else None
    num_cand = min(vocab_size, max(NUCLEUS_CANDIDATES, int(torch.where(k < vocab_size, k, 0).max()) if k is not None else 0))
    vals, idx = logits.topk(num_cand, dim=-1, sorted=True)
    if k is not None:
        positions = torch.arange(num_cand, device=logits.device)
        vals.masked_fill_(positions.unsqueeze(0) >= k.unsqueeze(1), float("-inf"))
        restricted = (k <= num_cand).unsqueeze(1)
        # Top-k rows renormalize over their k tokens; the others over the whole vocabulary.
        lse = torch.where(restricted, vals.logsumexp(dim=-1, keepdim=True), logits.logsumexp(dim=-1, keepdim=True))
    else:
        lse = logits.logsumexp(dim=-1, keepdim=True)
    probs = (vals - lse).exp_()
    cum = probs.cumsum(dim=-1)
    p = top_p.to(cum.dtype).unsqueeze(1)
    # Keep a token iff the mass of the tokens more likely than it is still below p.
    keep = (cum - probs) < p
    keep[:, 0] = True
    inside = cum[:, -1:] >= p
    if k is not None:
        inside |= restricted
    out = torch.full_like(logits, float("-inf"))
    out.scatter_(1, idx, vals.masked_fill_(~keep, float("-inf")))
    outside = ~inside.squeeze(1)
    if bool(outside.any()):
        rows = outside.nonzero().squeeze(1)
        out[rows] = _apply_top_k_top_p_sorted(
            logits[rows].clone(), top_k[rows] if top_k is not None else None, top_p[rows]
        )
    return logits.copy_(out)


def _apply_top_k_top_p_sorted(
    logits: torch.Tensor, top_k: Optional[torch.Tensor], top_p: Optional[torch.Tensor]
) -> torch.Tensor:
    """Applies top-k then top-p with a single ascending sort of each row.

    Top-p keeps the smallest set of most likely tokens whose mass reaches p: a token stays iff
    the mass of the tokens strictly more likely than it is below p (so the top token always
    stays). The mass is computed after top-k, i.e. on the renormalized top-k distribution.
    """
    if top_k is None and top_p is None:
        return logits
    if top_p is None:
        return apply_top_k_only(logits, top_k)
    vocab_size = logits.shape[1]
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        k = _effective_top_k(top_k, vocab_size)
        positions = torch.arange(vocab_size, device=logits.device)
        logits_sort.masked_fill_(positions.unsqueeze(0) < (vocab_size - k).unsqueeze(1), float("-inf"))
    probs_sort = logits_sort.softmax(dim=-1)
    # Ascending cumsum: entry i is the mass of token i and everything less likely than it.
    cum_probs = probs_sort.cumsum_(dim=-1)
    drop = cum_probs <= (1.0 - top_p.to(cum_probs.dtype)).unsqueeze(1)
    drop[:, -1] = False
    logits_sort.masked_fill_(drop, float("-inf"))
    return logits.scatter_(1, logits_idx, logits_sort)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drops tokens whose probability is below ``min_p`` times the row's top probability.

    ``p_i >= min_p * p_max`` is ``logit_i - logit_max >= log(min_p)``, so no softmax is needed;
    rows with min_p = 0 get a -inf threshold and keep everything.
    """
    max_logits = logits.amax(dim=-1, keepdim=True)
    threshold = max_logits + torch.log(min_p.to(logits.dtype)).unsqueeze(1)
    return logits.masked_fill_(logits < threshold, float("-inf"))
