"""Decode attention (one new token per sequence) straight from the paged cache, flash-decoding style.

One program per (sequence, kv head, KV split): the query heads that share the kv head are the rows
of one tile, so each key/value is read once for the whole GQA group. A context longer than one
partition is split across programs, each leaving a normalised partial output and its log-sum-exp;
a second kernel merges the splits. With one split the first kernel writes the output directly.

AttentionOptions: with a sliding window the splits cover only the window (keys before it are never
loaded: their blocks may be freed); the soft cap bends the scores before the mask; the sink joins
the first split's softmax as a score with no value (so once for the merged output).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagellm.attention.triton_kernels.kv_codec import kernel_view
from pagellm.attention.triton_kernels.kv_loop import KernelOptions, attend_kv_tiles, normalize
from pagellm.attention.triton_kernels.scores import LOG2E


@triton.jit
def _decode_kernel(
    q_ptr,
    cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    num_splits,
    partition,  # KV tokens per split, a multiple of BLOCK_N
    # KernelOptions.launch_args: runtime arguments, then (after this kernel's own) compile-time switches.
    scales_ptr, sinks_ptr, qk_scale, window, cap_log2,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cache_kv, stride_cache_block, stride_cache_tok, stride_cache_head, stride_bt,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_F32: tl.constexpr, KV_FORMAT: tl.constexpr, IS_FP8: tl.constexpr, FP8_UNIT: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_CAP: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = split * partition
    if HAS_WINDOW:
        # The new token at seq_len - 1 sees seq_len - window ... seq_len - 1; splits cover that.
        start += tl.maximum(seq_len - window, 0)
    end = tl.minimum(seq_len, start + partition)

    rows = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + rows
    mask_rows = rows < GROUP
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask_dims = dims < HEAD_DIM
    q = tl.load(
        q_ptr + seq * stride_qt + heads[:, None] * stride_qh + dims[None, :],
        mask=mask_rows[:, None] & mask_dims[None, :],
        other=0.0,
    )
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    if HAS_SINKS:
        # A score with no value, in the first split only: the merge then counts it once.
        sink = tl.load(sinks_ptr + heads, mask=mask_rows, other=float("-inf")) * LOG2E
        m_i = tl.where(split == 0, sink, m_i)
        l_i = tl.where((split == 0) & mask_rows, 1.0, l_i)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    # Every key of the split is in the context and in the token's window: no per-row mask.
    m_i, l_i, acc = attend_kv_tiles(
        q, m_i, l_i, acc, cache_ptr + kv_head * stride_cache_head, block_table_ptr + seq.to(tl.int64) * stride_bt,
        start, end, end, window, qk_scale, scales_ptr, cap_log2, stride_cache_kv, stride_cache_block, stride_cache_tok,
        HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE, BLOCK_N, DOT_F32, KV_FORMAT, IS_FP8, FP8_UNIT, HAS_CAP, CAUSAL=False, HAS_WINDOW=False,
    )

    # An empty split (or a padding sequence of length 0) has l == 0: its output is 0, its weight 0.
    out = normalize(acc, l_i, scales_ptr, IS_FP8, FP8_UNIT)
    mask_out = mask_rows[:, None] & mask_dims[None, :]
    if SINGLE_SPLIT:
        tl.store(
            out_ptr + seq * stride_ot + heads[:, None] * stride_oh + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=mask_out,
        )
    else:
        # part_out [S, H, splits, D] and part_lse [S, H, splits], contiguous float32.
        row = (seq * NUM_HEADS + heads).to(tl.int64) * num_splits + split
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + dims[None, :], out, mask=mask_out)
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))
        tl.store(part_lse_ptr + row, lse, mask=mask_rows)


@triton.jit
def _reduce_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    num_splits,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask_splits = splits < num_splits
    row = (seq * NUM_HEADS + head).to(tl.int64) * num_splits
    lse = tl.load(part_lse_ptr + row + splits, mask=mask_splits, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    weight = tl.exp2(lse - top)  # 0 for empty splits
    parts = tl.load(
        part_out_ptr + (row + splits)[:, None] * HEAD_DIM + dims[None, :],
        mask=mask_splits[:, None] & (dims < HEAD_DIM)[None, :],
        other=0.0,
    )
    total = tl.sum(weight, 0)
    out = tl.sum(parts * weight[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def decode_attention(
    out: torch.Tensor,  # [S, num_heads, head_dim], written
    query: torch.Tensor,  # [S, num_heads, head_dim], last dim contiguous
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, row_width]
    block_table: torch.Tensor,  # int32 [S, max_blocks], last dim contiguous
    seq_lens: torch.Tensor,  # int32 [S]
    num_splits: int,
    partition: int,
    options: KernelOptions,
) -> None:
    """``num_splits`` x ``partition`` must cover min(max_seq_len, window) keys (split_plan)."""
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    if num_splits > 1:
        part_out = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
        part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
    else:
        part_out = part_lse = out  # unused
    args, constexprs = options.launch_args(out, query, kv_cache, block_table)
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        query,
        kernel_view(kv_cache),
        block_table,
        seq_lens,
        out,
        part_out,
        part_lse,
        num_splits,
        partition,
        *args,
        NUM_HEADS=num_heads,
        GROUP=group,
        # tl.dot needs at least 16 rows; padding rows are masked out.
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        SINGLE_SPLIT=num_splits == 1,
        **constexprs,
    )
    if num_splits > 1:
        _reduce_kernel[(num_seqs, num_heads)](
            out,
            part_out,
            part_lse,
            num_splits,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
            SPLITS_PAD=triton.next_power_of_2(num_splits),
        )
