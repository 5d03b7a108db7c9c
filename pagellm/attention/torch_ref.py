"""The pure-PyTorch reference backend: slow, obviously correct, and the oracle for the others.

Every sequence is handled on its own: gather its context from the paged cache block by block,
then run causal attention of its new queries over that context in float32.
"""
from __future__ import annotations

from typing import Optional

import torch

from pagellm.attention.backend import AttentionBackend, AttentionMetadata
from pagellm.attention.kv_quant import UNIT_SCALES, KVScales, dequantize, write_kv_cache
from pagellm.attention.validation import check_attention_inputs


def gather_context(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, context_len: int, kv_scales: Optional[KVScales] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``context_len`` keys and values of one sequence, [context_len, num_kv_heads, head_dim]
    each, in float32 for an 8-bit cache (dequantized) and in the cache's dtype otherwise."""
    scales = kv_scales or UNIT_SCALES
    block_size = kv_cache.shape[2]
    num_blocks = -(-context_len // block_size)
    blocks = block_ids[:num_blocks].long()
    keys = kv_cache[0].index_select(0, blocks).reshape(num_blocks * block_size, *kv_cache.shape[3:])[:context_len]
    values = kv_cache[1].index_select(0, blocks).reshape(num_blocks * block_size, *kv_cache.shape[3:])[:context_len]
    if keys.dtype.is_floating_point and keys.element_size() > 1:
        return keys, values
    return dequantize(keys, scales.k_scale), dequantize(values, scales.v_scale)


def causal_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of the last ``q_len`` positions of a context over the whole context, in float32.

    query [q_len, num_heads, head_dim]; keys/values [context_len, num_kv_heads, head_dim].
    New token i sits at position context_len - q_len + i and sees positions <= its own.
    """
    q_len, num_heads, _ = query.shape
    context_len, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    # GQA: query head h reads kv head h // group.
    k = keys.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
    v = values.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
    q = query.float().transpose(0, 1)  # [H, q_len, D]
    scores = torch.matmul(q, k.transpose(1, 2)) * scale  # [H, q_len, L]
    query_pos = torch.arange(context_len - q_len, context_len, device=query.device)
    key_pos = torch.arange(context_len, device=query.device)
    visible = key_pos[None, :] <= query_pos[:, None]  # [q_len, L]
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v).transpose(0, 1)  # [q_len, H, D]


class TorchReferenceBackend(AttentionBackend):
    """One sequence at a time, straight from the definition."""

    name = "torch_ref"

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        kv_scales: Optional[KVScales] = None,
    ) -> torch.Tensor:
        check_attention_inputs(query, key, value, kv_cache, metadata)
        write_kv_cache(key, value, kv_cache, metadata.slot_mapping, kv_scales)
        output = torch.empty_like(query)
        starts = metadata.query_start_loc_cpu
        for i, context_len in enumerate(metadata.seq_lens_cpu):
            start, end = starts[i], starts[i + 1]
            if end == start:
                continue
            keys, values = gather_context(kv_cache, metadata.block_table[i], context_len, kv_scales)
            output[start:end] = causal_attention(query[start:end], keys, values, scale).to(output.dtype)
        return output
