"""Scatter this step's keys and values into their slots of the paged cache, one program per token,
in the cache's format (kv_codec)."""
from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from pagellm.attention.kv_quant import FP8_DTYPES
from pagellm.attention.triton_kernels.kv_codec import kernel_view, kv_format, store_rows


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,
    slot_ptr,
    scales_ptr,  # fp8: float32 [k_scale, v_scale]; read on the device so CUDA graphs see updates
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
    KV_FORMAT: tl.constexpr,
    IS_FP8: tl.constexpr,
    FP8_MANT: tl.constexpr,
    FP8_BIAS: tl.constexpr,
    FP8_MAX_BITS: tl.constexpr,
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
    head_mask = heads < NUM_KV_HEADS
    mask = head_mask[:, None] & (dims < HEAD_DIM)[None, :]
    # other=0: int8's row absmax must not see the padding lanes.
    k = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask, other=0.0)
    v = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask, other=0.0)
    row = cache_ptr + block * stride_cache_block + offset * stride_cache_tok + heads * stride_cache_head
    k_scale = 1.0
    v_scale = 1.0
    if IS_FP8:
        k_scale = tl.load(scales_ptr)
        v_scale = tl.load(scales_ptr + 1)
    store_rows(k, row, dims, mask, head_mask, k_scale, HEAD_DIM, KV_FORMAT, FP8_MANT, FP8_BIAS, FP8_MAX_BITS)
    store_rows(v, row + stride_cache_kv, dims, mask, head_mask, v_scale, HEAD_DIM, KV_FORMAT, FP8_MANT, FP8_BIAS,
                FP8_MAX_BITS)


def _fp8_params(dtype: torch.dtype) -> tuple[int, int, int]:
    """(mantissa bits, exponent bias, float32 bits of the largest finite value) of an fp8 format."""
    mant, bias = (3, 7) if dtype == torch.float8_e4m3fn else (2, 15)
    return mant, bias, struct.unpack("<I", struct.pack("<f", torch.finfo(dtype).max))[0]


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, scales: torch.Tensor
) -> None:
    """key/value [T, num_kv_heads, head_dim] (last dim contiguous) into kv_cache [2, blocks, block_size, kvh, row_width].

    ``scales`` is the float32 ``[k_scale, v_scale]`` device tensor, read only for an fp8 cache.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    is_fp8 = kv_cache.dtype in FP8_DTYPES
    mant, bias, max_bits = _fp8_params(kv_cache.dtype) if is_fp8 else (3, 7, 0)
    cache = kernel_view(kv_cache)
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        cache,
        slot_mapping,
        scales,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        cache.stride(0),
        cache.stride(1),
        cache.stride(2),
        cache.stride(3),
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=kv_cache.shape[2],
        KV_FORMAT=kv_format(kv_cache.dtype),
        IS_FP8=is_fp8,
        FP8_MANT=mant,
        FP8_BIAS=bias,
        FP8_MAX_BITS=max_bits,
    )
