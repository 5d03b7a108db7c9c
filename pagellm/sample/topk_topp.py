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


def apply_top_k_top_p(
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
