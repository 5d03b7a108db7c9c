"""Vectorised pure-torch backend: the default on accelerators and the CPU fallback.

Decodes (one new token each) go through one batched gather + matmul over the padded block
tables; prefill chunks go one sequence at a time through ``scaled_dot_product_attention`` on
accelerators and through a GQA-grouped float32 matmul + softmax on CPU (faster there). Both
gather the context out of the paged cache, which the C++ CPU kernel avoids. A layer's
:class:`AttentionOptions` go through the same paths (as torch_ref defines them); with a sliding
window only the blocks that meet some new token's window are gathered.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from pagellm.attention.backend import AttentionBackend, AttentionMetadata, AttentionOptions
from pagellm.attention.kv_quant import UNIT_SCALES, KVScales, dequantize
from pagellm.attention.torch_ref import causal_mask, first_visible_position, gather_context

# Cap on the gathered K (and V) bytes per decode sub-batch, so that long contexts in big
# batches do not allocate gigabytes at once.
_DECODE_GATHER_BYTES = 256 * 1024 * 1024


def _compute_dtype(query: torch.Tensor) -> torch.dtype:
    # Reduced precision is native on accelerators; on CPU float32 is both exact and fastest.
    return query.dtype if query.device.type != "cpu" else torch.float32


def decode_attention(
    query: torch.Tensor,  # [S, num_heads, head_dim], one new token per sequence
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,  # [S, >= blocks needed]
    seq_lens: torch.Tensor,  # [S]
    max_seq_len: int,
    scale: float,
    kv_scales: KVScales = UNIT_SCALES,
    options: Optional[AttentionOptions] = None,
) -> torch.Tensor:
    """Attention of each sequence's single new token over its whole context (or its window), batched."""
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    dtype = _compute_dtype(query)
    num_blocks = -(-max_seq_len // block_size)
    window = cap = sinks = None
    if options is not None:
        window, cap = options.sliding_window, options.logits_soft_cap
        sinks = options.sinks.float().view(num_kv_heads, group, 1) if options.sinks is not None else None
        if window is not None:
            # Positions p - window + 1 ... p span at most this many blocks, from the one p - window + 1 is in.
            num_blocks = min(num_blocks, (window + block_size - 2) // block_size + 1)
    padded_len = num_blocks * block_size
    row_bytes = padded_len * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8
    per_batch = max(1, _DECODE_GATHER_BYTES // max(1, row_bytes))
    output = torch.empty(num_seqs, num_heads, head_dim, dtype=query.dtype, device=query.device)
    positions = torch.arange(padded_len, device=query.device)
    for start in range(0, num_seqs, per_batch):
        end = min(num_seqs, start + per_batch)
        n = end - start
        if window is None:
            blocks = block_table[start:end, :num_blocks].flatten().long()
            valid = positions[None, :] < seq_lens[start:end, None].long()  # [n, L]
        else:
            lens = seq_lens[start:end, None].long()
            first_block = (lens - window).clamp(min=0) // block_size  # [n, 1]
            # Columns past a table's width only hold positions past the context, masked below.
            columns = (first_block + torch.arange(num_blocks, device=query.device)).clamp(max=block_table.shape[1] - 1)
            blocks = block_table[start:end].long().gather(1, columns).flatten()
            key_pos = first_block * block_size + positions[None, :]
            valid = (key_pos < lens) & (key_pos >= lens - window)  # [n, L]
        # index_select, not advanced indexing: a plain gather copy, without indexing's general machinery.
        keys = dequantize(kv_cache[0].index_select(0, blocks), kv_scales.k_scale, dtype).view(n, padded_len, num_kv_heads, head_dim)
        values = dequantize(kv_cache[1].index_select(0, blocks), kv_scales.v_scale, dtype).view(n, padded_len, num_kv_heads, head_dim)
        # Padding slots may hold anything (even NaN): zero the values so 0-probability stays 0.
        if query.device.type == "cpu":
            # Touch only the padding rows; on accelerators a full masked pass is cheap and sync-free.
            padding = (~valid).flatten().nonzero().squeeze(1)
            values.view(n * padded_len, -1).index_fill_(0, padding, 0.0)
        else:
            values.masked_fill_(~valid[:, :, None, None], 0.0)
        q = query[start:end].to(dtype).view(n, num_kv_heads, group, head_dim)
        out = torch.empty(n, num_kv_heads, group, head_dim, dtype=dtype, device=query.device)
        # One bmm per kv head: its [n, L, D] slice is a plain strided batch, so nothing is
        # copied into a [n, kvh, L, D] layout first.
        for h in range(num_kv_heads):
            scores = torch.bmm(q[:, h], keys[:, :, h].transpose(1, 2)).float() * scale  # [n, g, L]
            if cap is not None:
                scores = torch.tanh(scores / cap) * cap
            scores.masked_fill_(~valid[:, None, :], float("-inf"))
            if sinks is not None:
                probs = torch.softmax(torch.cat([scores, sinks[h].expand(n, group, 1)], dim=-1), dim=-1)[..., :-1].to(dtype)
            else:
                probs = torch.softmax(scores, dim=-1).to(dtype)
            out[:, h] = torch.bmm(probs, values[:, :, h])
        output[start:end] = out.view(n, num_heads, head_dim).to(query.dtype)
    return output


def prefill_attention(
    query: torch.Tensor,  # [q_len, num_heads, head_dim]
    kv_cache: torch.Tensor,
    block_ids: torch.Tensor,  # this sequence's block-table row
    context_len: int,
    scale: float,
    kv_scales: KVScales = UNIT_SCALES,
    options: Optional[AttentionOptions] = None,
) -> torch.Tensor:
    """Causal attention of one sequence's last q_len positions over its context (or their windows)."""
    first = first_visible_position(context_len, query.shape[0], options)
    # An 8-bit cache comes widened to float32 here, to the compute dtype below.
    keys, values = gather_context(kv_cache, block_ids, context_len, kv_scales, first)
    # SDPA has no soft cap or sinks: those take the float32 matmul path on every device.
    if query.device.type == "cpu" or (options is not None and (options.logits_soft_cap is not None or options.sinks is not None)):
        return _prefill_matmul(query, keys, values, scale, options, first)
    return _prefill_sdpa(query, keys, values, scale, options, first)


def _prefill_sdpa(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    options: Optional[AttentionOptions] = None,
    key_start: int = 0,
) -> torch.Tensor:
    """SDPA over keys at positions key_start ...; of the options only a window (a mask) applies here."""
    q_len, num_heads, _ = query.shape
    num_keys, num_kv_heads, _ = keys.shape
    context_len = key_start + num_keys
    window = options.sliding_window if options is not None else None
    dtype = _compute_dtype(query)
    q = query.transpose(0, 1).to(dtype)  # [H, q_len, D]
    k = keys.transpose(0, 1).to(dtype)
    v = values.transpose(0, 1).to(dtype)
    if num_heads != num_kv_heads:
        group = num_heads // num_kv_heads
        k = k.repeat_interleave(group, dim=0)
        v = v.repeat_interleave(group, dim=0)
    if q_len == context_len and window is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        # SDPA's is_causal aligns the corners top-left; a cached prefix needs bottom-right.
        mask = causal_mask(q_len, context_len, query.device, window, key_start)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.transpose(0, 1).to(query.dtype)


# Cap on one score matrix in the CPU prefill path; longer prefills go in query chunks.
_PREFILL_SCORE_BYTES = 64 * 1024 * 1024


def _prefill_matmul(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    options: Optional[AttentionOptions] = None,
    key_start: int = 0,
) -> torch.Tensor:
    """Float32 matmul + softmax, GQA by grouping query heads per kv head (no K/V repeat); keys at
    positions key_start ... the context's end.

    On CPU this beats SDPA's kernels for these shapes and keeps float32 exact.
    """
    q_len, num_heads, head_dim = query.shape
    num_keys, num_kv_heads, _ = keys.shape
    context_len = key_start + num_keys
    group = num_heads // num_kv_heads
    window = cap = sinks = None
    if options is not None:
        window, cap = options.sliding_window, options.logits_soft_cap
        sinks = options.sinks.float().view(num_kv_heads, group, 1, 1) if options.sinks is not None else None
    q = query.float().view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [kvh, g, q_len, D]
    k_t = keys.float().permute(1, 2, 0)  # [kvh, D, L]
    v = values.float().transpose(0, 1)  # [kvh, L, D]
    mask = causal_mask(q_len, context_len, query.device, window, key_start)
    out = torch.empty(num_kv_heads, group, q_len, head_dim, dtype=torch.float32, device=query.device)
    rows_per_chunk = max(1, _PREFILL_SCORE_BYTES // (4 * num_heads * num_keys))
    if window is not None:
        # A chunk of rows reads only the keys of its rows' windows: rows + window - 1 of them.
        rows_per_chunk = max(1, min(q_len, _PREFILL_SCORE_BYTES // (8 * num_heads * window), max(64, window)))
    first_query_index = context_len - q_len - key_start  # key index of the first new token
    for c0 in range(0, q_len, rows_per_chunk):
        c1 = min(q_len, c0 + rows_per_chunk)
        k0, k1 = 0, num_keys
        if window is not None:
            k0, k1 = max(0, first_query_index + c0 - window + 1), first_query_index + c1
        rows = q[:, :, c0:c1].reshape(num_kv_heads, group * (c1 - c0), head_dim)
        scores = torch.matmul(rows, k_t[:, :, k0:k1]).view(num_kv_heads, group, c1 - c0, k1 - k0) * scale
        if cap is not None:
            scores = torch.tanh(scores / cap) * cap
        scores.masked_fill_(~mask[c0:c1, k0:k1], float("-inf"))
        if sinks is not None:
            sink_column = sinks.expand(num_kv_heads, group, c1 - c0, 1)
            probs = torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1)[..., :-1]
            probs = probs.reshape(num_kv_heads, group * (c1 - c0), k1 - k0)
        else:
            probs = torch.softmax(scores, dim=-1).view(num_kv_heads, group * (c1 - c0), k1 - k0)
        out[:, :, c0:c1] = torch.matmul(probs, v[:, k0:k1]).view(num_kv_heads, group, c1 - c0, head_dim)
    return out.permute(2, 0, 1, 3).reshape(q_len, num_heads, head_dim).to(query.dtype)


def torch_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    kv_scales: Optional[KVScales] = None,
    options: Optional[AttentionOptions] = None,
) -> torch.Tensor:
    """Attention over an already-written cache: decodes batched, prefill chunks one by one.
    ``options`` must have been through check_attention_options (None when plain)."""
    kv_scales = kv_scales or UNIT_SCALES
    starts = metadata.query_start_loc_cpu
    seq_lens = metadata.seq_lens_cpu
    output = torch.empty_like(query)
    if metadata.num_tokens == 0:
        return output
    if metadata.num_tokens == metadata.num_seqs and metadata.max_query_len <= 1:
        return decode_attention(
            query, kv_cache, metadata.block_table, metadata.seq_lens, metadata.max_seq_len, scale, kv_scales, options
        )
    decode_seqs = [i for i in range(metadata.num_seqs) if starts[i + 1] - starts[i] == 1]
    if decode_seqs:
        seq_index = torch.tensor(decode_seqs, device=query.device)
        token_index = torch.tensor([starts[i] for i in decode_seqs], device=query.device)
        output[token_index] = decode_attention(
            query[token_index],
            kv_cache,
            metadata.block_table.index_select(0, seq_index),
            metadata.seq_lens.index_select(0, seq_index),
            max(seq_lens[i] for i in decode_seqs),
            scale,
            kv_scales,
            options,
        )
    for i in range(metadata.num_seqs):
        start, end = starts[i], starts[i + 1]
        if end - start > 1:
            output[start:end] = prefill_attention(
                query[start:end], kv_cache, metadata.block_table[i], seq_lens[i], scale, kv_scales, options
            )
    return output


class TorchSdpaBackend(AttentionBackend):
    """Vectorised torch: works on every device torch supports."""

    name = "torch_sdpa"

    # Attention over the written cache, decodes batched: torch_attention is all this backend adds.
    attend = staticmethod(torch_attention)
