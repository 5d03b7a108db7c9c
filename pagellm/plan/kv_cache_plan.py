"""How many KV cache blocks an engine gets, what each costs, and how long a context they hold.

The one place this arithmetic lives: the resolved configuration plans the cache from its budget
before anything loads, and the engine core plans it again only when the budget is known later (a
GPU's free memory after the weights are in) or a benchmark swaps the KV cache manager.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from pagellm.config import DEFAULT_KV_CACHE_MEMORY_BYTES, EngineConfig
from pagellm.core.kv_cache_base import kv_cache_manager_class
from pagellm.core.kv_cache_groups import KVCacheLayout, group_layers, single_group_layout
from pagellm.core.kv_cache_manager import KVCacheManager  # noqa: F401  (registers "paged")
from pagellm.distributed.partition import max_kv_heads_per_rank
from pagellm.models.shape import ModelShape
from pagellm.worker.kv_cache import bytes_per_block, determine_num_blocks, grouped_bytes_per_block

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVCachePlan:
    """One rank's KV cache: ``num_blocks`` pool blocks of ``block_bytes`` (the rank holding the
    most KV heads; a draft model's layers share each block), laid out by attention kind."""

    layout: KVCacheLayout
    block_size: int
    num_kv_heads: int  # per rank
    block_bytes: int
    num_blocks: int
    max_model_len: int  # the model's or the user's, lowered to what one request can hold
    # A hybrid model's recurrent state: slots (live ones and prefix-cache checkpoints) of every
    # recurrent layer's state, on one rank, carved from the same budget as the blocks.
    num_state_slots: int = 0
    state_slot_bytes: int = 0
    # Under speculative decoding, the slots each running request holds for its drafts' states.
    num_state_draft_slots: int = 0

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.block_bytes + self.state_bytes

    @property
    def state_bytes(self) -> int:
        return self.num_state_slots * self.state_slot_bytes

    @property
    def num_tokens(self) -> int:
        """Tokens of full context (vLLM's count: the usable blocks shared evenly by the groups)."""
        layout = self.layout
        return (self.num_blocks - layout.num_reserved_blocks) // layout.num_groups * self.block_size


def kv_cache_layout_for(shape: ModelShape, kv_cache_manager: str = "paged") -> KVCacheLayout:
    """The model's KV cache groups; a manager that keeps whole contexts gets one full-attention group."""
    manager = kv_cache_manager_class(kv_cache_manager)
    if shape.is_hybrid:
        if not getattr(manager, "supports_recurrent_state", False):
            raise ValueError(f"the {kv_cache_manager!r} KV cache manager cannot keep a hybrid model's recurrent state; use 'paged'")
        return group_layers(shape.layer_sliding_windows, shape.state_layer_ids, shape.no_cache_layer_ids, shape.kv_shared_layers)
    if shape.no_cache_layer_ids or shape.kv_shared_layers:
        if not manager.supports_sliding_window:
            raise ValueError(f"the {kv_cache_manager!r} KV cache manager cannot keep layers that share or skip a KV cache; use 'paged'")
        return group_layers(shape.layer_sliding_windows, (), shape.no_cache_layer_ids, shape.kv_shared_layers)
    if manager.supports_sliding_window:
        return group_layers(shape.layer_sliding_windows)
    return single_group_layout(shape.num_layers)


def num_state_draft_slots(config: EngineConfig) -> int:
    """Slots a hybrid model's running request holds for its drafts: one per draft a step verifies
    (the state after each accepted prefix of them), none without speculative decoding."""
    spec = config.speculative_config
    return spec.num_speculative_tokens if spec is not None else 0


def plan_state_slots(config: EngineConfig, slot_bytes: int, budget: int) -> int:
    """State slots for a hybrid model: what each request the batch may hold needs (one, and one per
    draft under speculative decoding) plus one per request for prefix checkpoints, within three
    quarters of the budget. A hybrid's attention layers are few, so a quarter still holds tens of
    thousands of tokens of KV, while a slot costs as much as a thousand tokens of it: a smaller
    share would cap the batch and evict the checkpoints prefixes resume from."""
    per_request = 1 + num_state_draft_slots(config)
    if config.num_state_slots is not None:
        if config.num_state_slots < per_request:
            raise ValueError(
                f"num_state_slots={config.num_state_slots} cannot hold one request's state and its "
                f"{per_request - 1} draft states; set at least {per_request}"
            )
        return config.num_state_slots
    wanted = config.max_num_seqs * (per_request + (1 if config.enable_prefix_caching else 0))
    return max(per_request + 1, min(wanted, budget * 3 // 4 // slot_bytes))


def plan_kv_cache(
    config: EngineConfig,
    shape: ModelShape,
    kv_cache_dtype: torch.dtype,
    max_model_len: int,
    layout: KVCacheLayout,
    draft_shape: Optional[ModelShape] = None,
    budget_bytes: Optional[int] = None,
    conv_state_dtype: torch.dtype = torch.float32,
    ssm_state_dtype: torch.dtype = torch.float32,
) -> KVCachePlan:
    """Blocks from ``num_kv_blocks``, else from ``budget_bytes`` (a GPU's free memory), else the
    configured or default budget. A ``max_model_len`` the cache cannot hold for one request is an
    error when the user set it, and is lowered with a warning when it was the model's own."""
    kv_heads = max_kv_heads_per_rank(shape.num_kv_heads, config.tensor_parallel_size)
    block_size = config.block_size
    if shape.layer_kv_heads:  # layers of different shapes: each group position's tensor has its widest row
        per_rank = [(max_kv_heads_per_rank(h, config.tensor_parallel_size), d) for h, d in shape.layer_kv_heads]
        block_bytes = grouped_bytes_per_block(layout, per_rank, block_size, kv_cache_dtype)
    else:
        block_bytes = bytes_per_block(layout.group_size, block_size, kv_heads, shape.head_dim, kv_cache_dtype)
    if draft_shape is not None:
        if not layout.plain:
            raise ValueError("a speculative draft model needs a target whose layers all attend in full; use 'ngram'")
        # The draft's cache has the same blocks, so a block of the budget holds both models' KV.
        block_bytes += bytes_per_block(draft_shape.num_layers, block_size, draft_shape.num_kv_heads, draft_shape.head_dim, kv_cache_dtype)
    budget = budget_bytes if budget_bytes is not None else config.kv_cache_memory_bytes
    num_state_slots = state_slot_bytes = 0
    if shape.is_hybrid:
        if draft_shape is not None:
            raise ValueError("speculative decoding with a draft model is not supported for hybrid (recurrent) models")
        state_slot_bytes = shape.state_slot_bytes(conv_state_dtype, ssm_state_dtype, config.tensor_parallel_size)
        total = budget if budget is not None else DEFAULT_KV_CACHE_MEMORY_BYTES
        num_state_slots = plan_state_slots(config, state_slot_bytes, total)
        if config.num_kv_blocks is None:
            budget = total - num_state_slots * state_slot_bytes
            if budget <= 0:
                raise ValueError(
                    f"a KV cache budget of {total / 2**20:.0f} MiB holds no {num_state_slots} state slots of "
                    f"{state_slot_bytes / 2**20:.1f} MiB (a hybrid request's recurrent state) besides KV blocks; "
                    "raise the KV cache budget (--kv-cache-memory) or lower --num-state-slots"
                )
    num_blocks = determine_num_blocks(config.num_kv_blocks, budget, DEFAULT_KV_CACHE_MEMORY_BYTES, block_bytes, block_size, max_model_len)
    # A request longer than the whole cache could never be scheduled and would wait forever.
    chunk = config.max_num_batched_tokens
    needed = layout.max_blocks_per_request(max_model_len, block_size, chunk) + layout.num_reserved_blocks
    if needed > num_blocks:
        capacity = layout.max_tokens_that_fit(num_blocks, block_size, chunk, max_model_len)
        groups = "" if layout.plain else f", {layout.describe()}"
        if config.max_model_len is not None:
            raise ValueError(
                f"max_model_len={max_model_len} does not fit in the KV cache, which holds {capacity} tokens "
                f"({num_blocks} blocks of {block_size}{groups}); raise the KV cache budget or lower max_model_len"
            )
        logger.warning("the KV cache holds %d tokens: max_model_len lowered from %d to %d", capacity, max_model_len, capacity)
        max_model_len = capacity
    num_draft_slots = num_state_draft_slots(config) if shape.is_hybrid else 0
    return KVCachePlan(
        layout, block_size, kv_heads, block_bytes, num_blocks, max_model_len, num_state_slots, state_slot_bytes, num_draft_slots
    )
