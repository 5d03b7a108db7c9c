"""The pure-PyTorch reference backend: slow, obviously correct, and the oracle for the others.

Every sequence is handled on its own: gather its context from the paged cache block by block,
then run causal attention of its new queries over that context in float32. A layer's
:class:`AttentionOptions` follow transformers' eager attention: the soft cap before the mask, the
window as one more mask, the sinks as one more softmax column that is dropped afterwards.
"""
from __future__ import annotations

from typing import Optional

import torch

from pagellm.attention.backend import AttentionBackend, AttentionMetadata, AttentionOptions
from pagellm.attention.kv_quant import UNIT_SCALES, KVScales, dequantize


def gather_context(
    kv_cache: torch.Tensor,
    block_ids: torch.Tensor,
    context_len: int,
    kv_scales: Optional[KVScales] = None,
    start: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of positions ``start ... context_len - 1`` of one sequence, [context_len - start,
    num_kv_heads, head_dim] each, in float32 for an 8-bit cache (dequantized) and in the cache's
    dtype otherwise. Blocks wholly before ``start`` are not touched (a sliding window may have freed them)."""
    scales = kv_scales or UNIT_SCALES
    block_size = kv_cache.shape[2]
    first_block = start // block_size
    num_blocks = -(-context_len // block_size) - first_block
    blocks = block_ids[first_block:first_block + num_blocks].long()
    skip, end = start - first_block * block_size, context_len - first_block * block_size
    keys = kv_cache[0].index_select(0, blocks).reshape(num_blocks * block_size, *kv_cache.shape[3:])[skip:end]
    values = kv_cache[1].index_select(0, blocks).reshape(num_blocks * block_size, *kv_cache.shape[3:])[skip:end]
    if keys.dtype.is_floating_point and keys.element_size() > 1:
        return keys, values
    return dequantize(keys, scales.k_scale), dequantize(values, scales.v_scale)


def first_visible_position(context_len: int, q_len: int, options: Optional[AttentionOptions]) -> int:
    """The lowest key position any of a sequence's new tokens may see: 0, or its first new token's
    window start (every block wholly before it may have been freed)."""
    if options is None or options.sliding_window is None:
        return 0
    return max(0, context_len - q_len - options.sliding_window + 1)


def causal_mask(
    q_len: int, context_len: int, device: torch.device, window: Optional[int] = None, key_start: int = 0
) -> torch.Tensor:
    """[q_len, context_len - key_start], True where new token i (at position context_len - q_len + i)
    may look at key position key_start + j: causal, and inside its window if there is one."""
    query_pos = torch.arange(context_len - q_len, context_len, device=device)
    key_pos = torch.arange(key_start, context_len, device=device)
    mask = key_pos[None, :] <= query_pos[:, None]
    if window is not None:
        mask &= key_pos[None, :] > query_pos[:, None] - window
    return mask


def causal_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    options: Optional[AttentionOptions] = None,
    key_start: int = 0,
) -> torch.Tensor:
    """Attention of the last ``q_len`` positions of a context over the whole context, in float32.

    query [q_len, num_heads, head_dim]; keys/values [num_keys, num_kv_heads, head_dim] for positions
    ``key_start ... key_start + num_keys - 1`` (the context's end). New token i sits at position
    context_len - q_len + i and sees positions <= its own (and inside its window, with ``options``).
    """
    q_len, num_heads, _ = query.shape
    num_keys, num_kv_heads, _ = keys.shape
    context_len = key_start + num_keys
    group = num_heads // num_kv_heads
    # GQA: query head h reads kv head h // group.
    k = keys.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
    v = values.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
    q = query.float().transpose(0, 1)  # [H, q_len, D]
    scores = torch.matmul(q, k.transpose(1, 2)) * scale  # [H, q_len, L]
    if options is not None and options.logits_soft_cap is not None:
        # transformers (Gemma 2) caps before masking.
        cap = options.logits_soft_cap
        scores = torch.tanh(scores / cap) * cap
    window = options.sliding_window if options is not None else None
    scores = scores.masked_fill(~causal_mask(q_len, context_len, query.device, window, key_start), float("-inf"))
    if options is not None and options.sinks is not None:
        # gpt-oss: the sink is one more logit per head in the softmax, dropped afterwards.
        sinks = options.sinks.float()[:, None, None].expand(num_heads, q_len, 1)
        probs = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v).transpose(0, 1)  # [q_len, H, D]


class TorchReferenceBackend(AttentionBackend):
    """One sequence at a time, straight from the definition."""

    name = "torch_ref"

    def attend(
        self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float, kv_scales: KVScales,
        options: Optional[AttentionOptions],
    ) -> torch.Tensor:
        output = torch.empty_like(query)
        starts = metadata.query_start_loc_cpu
        for i, context_len in enumerate(metadata.seq_lens_cpu):
            start, end = starts[i], starts[i + 1]
            if end == start:
                continue
            first = first_visible_position(context_len, end - start, options)
            keys, values = gather_context(kv_cache, metadata.block_table[i], context_len, kv_scales, first)
            output[start:end] = causal_attention(query[start:end], keys, values, scale, options, first).to(output.dtype)
        return output
