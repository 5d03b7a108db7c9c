"""Input checks shared by every attention backend; bad input raises ValueError."""
from __future__ import annotations

import math
from numbers import Integral, Real
from typing import TYPE_CHECKING, Optional

import torch

from pagellm.attention.kv_quant import row_width

if TYPE_CHECKING:  # backend.py calls these checks
    from pagellm.attention.backend import AttentionMetadata, AttentionOptions

# The per-sequence checks walk Python lists; one metadata object serves every layer of a step,
# so it is checked once and marked rather than re-walked per layer.
_CHECKED_MARK = "_pagellm_attention_checked"


def check_attention_inputs(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
) -> None:
    """Raise ValueError unless the tensors and metadata describe one consistent batch."""
    if query.dim() != 3 or key.dim() != 3 or value.dim() != 3:
        raise ValueError(
            f"query/key/value must be [T, heads, head_dim]; got {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"kv_cache must be [2, num_blocks, block_size, num_kv_heads, row_width]; got {tuple(kv_cache.shape)}")
    num_tokens, num_heads, head_dim = query.shape
    _, num_blocks, block_size, num_kv_heads, cache_row_width = kv_cache.shape
    if key.shape != (num_tokens, num_kv_heads, head_dim) or value.shape != key.shape:
        raise ValueError(
            f"key/value must be [{num_tokens}, {num_kv_heads}, {head_dim}] to match query and kv_cache; "
            f"got {tuple(key.shape)}, {tuple(value.shape)}"
        )
    if cache_row_width != row_width(head_dim, kv_cache.dtype):
        raise ValueError(
            f"kv_cache rows of {cache_row_width} {kv_cache.dtype} elements do not fit query head_dim {head_dim} "
            f"(expected {row_width(head_dim, kv_cache.dtype)})"
        )
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    if metadata.slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must have {num_tokens} entries; got shape {tuple(metadata.slot_mapping.shape)}")
    if getattr(metadata, _CHECKED_MARK, None) == (num_tokens, block_size, num_blocks):
        return
    _check_metadata(metadata, num_tokens, block_size)
    setattr(metadata, _CHECKED_MARK, (num_tokens, block_size, num_blocks))


def _check_metadata(metadata: AttentionMetadata, num_tokens: int, block_size: int) -> None:
    starts = metadata.query_start_loc_cpu
    seq_lens = metadata.seq_lens_cpu
    num_seqs = len(seq_lens)
    if len(starts) != num_seqs + 1 or starts[0] != 0 or starts[-1] != num_tokens:
        raise ValueError(
            f"query_start_loc_cpu must have {num_seqs + 1} entries from 0 to {num_tokens}; got {starts[:4]}...{starts[-2:]}"
        )
    table = metadata.block_table
    if table.dim() != 2 or table.shape[0] < num_seqs:
        raise ValueError(f"block_table must be [num_seqs={num_seqs}, max_blocks]; got {tuple(table.shape)}")
    max_query_len = 0
    max_seq_len = 0
    for i in range(num_seqs):
        q_len = starts[i + 1] - starts[i]
        if q_len < 0:
            raise ValueError(f"query_start_loc_cpu must not decrease (sequence {i})")
        if seq_lens[i] < q_len:
            raise ValueError(f"sequence {i}: seq_len {seq_lens[i]} is shorter than its {q_len} new tokens")
        max_query_len = max(max_query_len, q_len)
        max_seq_len = max(max_seq_len, seq_lens[i])
    if -(-max_seq_len // block_size) > table.shape[1]:
        raise ValueError(f"block_table has {table.shape[1]} columns; a {max_seq_len}-token context needs more")
    if max_query_len > metadata.max_query_len or max_seq_len > metadata.max_seq_len:
        raise ValueError(
            f"max_query_len/max_seq_len ({metadata.max_query_len}, {metadata.max_seq_len}) are below the batch's "
            f"({max_query_len}, {max_seq_len})"
        )


def check_attention_options(options: Optional[AttentionOptions], query: torch.Tensor) -> Optional[AttentionOptions]:
    """``options`` if they ask for anything beyond plain attention, else None (so that backends take
    their plain path untouched); ValueError for a window below 1, a cap that is not a positive finite
    number, or sinks that are not a float tensor of one value per query head on the query's device."""
    if options is None or options.plain:
        return None
    window = options.sliding_window
    if window is not None and (isinstance(window, bool) or not isinstance(window, Integral) or window < 1):
        raise ValueError(f"sliding_window must be an int >= 1 (or None), got {window!r}")
    cap = options.logits_soft_cap
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, Real) or not math.isfinite(cap) or cap <= 0):
        raise ValueError(f"logits_soft_cap must be a positive finite number (or None), got {cap!r}")
    sinks = options.sinks
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or not sinks.dtype.is_floating_point:
            raise ValueError(f"sinks must be a float tensor, got {type(sinks).__name__} {getattr(sinks, 'dtype', '')}")
        if sinks.shape != (query.shape[1],):
            raise ValueError(f"sinks must hold one value per query head, shape ({query.shape[1]},); got {tuple(sinks.shape)}")
        if sinks.device != query.device:
            raise ValueError(f"sinks must be on the query's device {query.device}, not {sinks.device}")
    return options
