"""The attention backend interface.

One forward pass covers a flat batch of T new tokens that belong to S sequences, in sequence
order: prefill chunks (many new tokens, causal over the cached prefix plus themselves) and
decodes (one new token) mixed freely. Keys and values live in a paged cache; each sequence
reaches its blocks through one row of the block table.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from pagellm.attention.kv_quant import UNIT_SCALES, KVScales, write_kv_cache
from pagellm.attention.validation import check_attention_inputs, check_attention_options

if TYPE_CHECKING:
    from pagellm.kernels.context import KernelContext


@dataclass
class AttentionMetadata:
    """Where each sequence's tokens are, for one forward pass.

    Sequence i owns new tokens ``query_start_loc[i]:query_start_loc[i+1]`` of the flat batch;
    its context after this step is ``seq_lens[i]`` tokens long, so its first new token sits at
    position ``seq_lens[i] - (query_start_loc[i+1] - query_start_loc[i])``.
    """

    query_start_loc: torch.Tensor  # int32 [S + 1], on the model's device
    seq_lens: torch.Tensor  # int32 [S], on the model's device
    block_table: torch.Tensor  # int32 [S, max_num_blocks_per_seq], on the model's device; unused entries are 0
    slot_mapping: torch.Tensor  # int64 [T]: block_id * block_size + offset, where each new K/V goes
    max_query_len: int
    max_seq_len: int
    # Host copies, so backends can plan without a device sync.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1]


@dataclass(eq=False)
class AttentionOptions:
    """How one layer attends, beyond plain causal softmax attention (every field off by default).

    - ``sliding_window``: a query at position p attends to keys at positions p - window + 1 ... p
      (transformers' ``kv_idx > q_idx - sliding_window``); keys before that are never read, so the
      KV cache manager may free blocks that lie wholly before every query's window.
    - ``logits_soft_cap``: scores (after ``scale``) become ``cap * tanh(score / cap)`` (Gemma 2).
    - ``sinks``: float32 ``[num_heads]`` (this rank's query heads), one extra logit per head that
      joins each row's softmax denominator but has no value (gpt-oss's attention sinks).
    """

    sliding_window: Optional[int] = None
    logits_soft_cap: Optional[float] = None
    sinks: Optional[torch.Tensor] = None

    @property
    def plain(self) -> bool:
        return self.sliding_window is None and self.logits_soft_cap is None and self.sinks is None


class AttentionBackend(ABC):
    """Writes the new keys/values into the paged cache, then attends over each sequence's context.

    ``forward`` is the same for every backend: the shared input checks, the backend's own
    (``check_supported``), the cache write (``write_cache``), then ``attend``.
    """

    name: str = "base"
    # Whether forward takes q/k/v whose tokens are strided (views into one fused q/k/v projection
    # output, each token's heads contiguous); otherwise callers pass contiguous tensors.
    accepts_strided_qkv: bool = False

    def use_kernel_context(self, kernels: KernelContext) -> None:
        """Reads what was measured about this machine at start-up from ``kernels`` (the model's,
        pagellm.kernels.context) at each call from now on; only the C++ backend reads any."""
        self.kernels = kernels

    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, row_width]; [0]=K, [1]=V
        metadata: AttentionMetadata,
        scale: float,
        kv_scales: Optional[KVScales] = None,  # an fp8 cache's per-layer scales (kv_quant); None: 1.0
        options: Optional[AttentionOptions] = None,  # this layer's window, soft cap, sinks; None: plain
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Bad input raises ValueError before anything is written."""
        check_attention_inputs(query, key, value, kv_cache, metadata)
        options = check_attention_options(options, query)
        self.check_supported(query, kv_cache)
        kv_scales = kv_scales or UNIT_SCALES
        self.write_cache(query, key, value, kv_cache, metadata, kv_scales)
        return self.attend(query, kv_cache, metadata, scale, kv_scales, options)

    def check_supported(self, query: torch.Tensor, kv_cache: torch.Tensor) -> None:
        """Raises ValueError for inputs (already through the shared checks) this backend cannot take."""
        return None

    def write_cache(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
        kv_scales: KVScales,
    ) -> None:
        """Scatters the new keys and values into their slots (torch's kv_quant.write_kv_cache here)."""
        write_kv_cache(key, value, kv_cache, metadata.slot_mapping, kv_scales)

    @abstractmethod
    def attend(
        self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float, kv_scales: KVScales,
        options: Optional[AttentionOptions],
    ) -> torch.Tensor:
        """Attention over the cache with this step's keys and values written; ``options`` are None
        when plain (check_attention_options)."""

