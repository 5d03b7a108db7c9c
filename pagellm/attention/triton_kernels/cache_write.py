"""Scatter this step's keys and values into their slots of the paged cache, one program per token."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cache_kv,
    stride_cache_block,
    stride_cache_tok,
    stride_cache_head,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    # A negative slot marks a padding token (CUDA-graph batches): nothing to write.
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads < NUM_KV_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]
    k = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    dst = cache_ptr + block * stride_cache_block + offset * stride_cache_tok + heads[:, None] * stride_cache_head + dims[None, :]
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_cache_kv, v.to(cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key/value [T, num_kv_heads, head_dim] (last dim contiguous) into kv_cache [2, blocks, block_size, kvh, D]."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        kv_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=kv_cache.shape[2],
    )
