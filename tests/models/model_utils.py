"""Helpers for model tests: tiny random checkpoints and a paged-cache driver."""
from __future__ import annotations

import random
from typing import Optional

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig

from pagellm.attention.backend import AttentionMetadata
from pagellm.attention.kv_quant import narrow_kv_view
from pagellm.models.shape import ModelShape

# The tiny Qwen3.5 / Qwen3-Next fields (Gated DeltaNet beside gated attention) of the hybrid model tests
# (tests/models/test_hybrid_models.py) and the disk tier's hybrid test.
TINY_QWEN3_5 = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, max_position_embeddings=256, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
)


def make_random_hf_model(config: PretrainedConfig, seed: int = 0, model_class: Optional[type] = None) -> nn.Module:
    """A transformers model with every weight random and O(0.1), norms and biases included.

    transformers initializes norms to 1 and biases to 0, which would hide a norm or bias loaded
    into the wrong place; larger weights also make logit mismatches visible above fp32 noise.
    ``model_class``: another class than AutoModelForCausalLM's for the config (an image-text one).
    """
    torch.manual_seed(seed)
    if model_class is None:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    else:
        model = model_class._from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.1)
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):  # Gemma 4's learnt per-layer scalars, a buffer in transformers
                buffer.copy_(1.0 + 0.1 * torch.randn_like(buffer))
    return model


class PagedDriver:
    """Runs a pagellm model step by step over several sequences sharing one paged KV cache.

    Blocks are handed out from a shuffled free list, so each sequence's block table is
    scattered and out of order. Unused cache slots hold NaN, so reading the wrong slot shows, as
    does reading past a narrower layer's part of a padded row.
    """

    def __init__(self, model: nn.Module, hf_config: PretrainedConfig, block_size: int = 4, num_blocks: int = 64, seed: int = 0) -> None:
        self.model = model
        self.block_size = block_size
        param = next(model.parameters())
        shape = ModelShape.from_hf_config(hf_config)
        # Layers of different KV shapes: each narrower layer's cache pads into rows of the widest
        # shape, as the engine lays them out (pagellm.worker.kv_cache), NaN past its part.
        widest = max((shape.kv_heads_of(i) for i in range(shape.num_layers)), key=lambda s: s[0] * s[1])
        self.kv_caches = []
        for i in range(shape.num_layers):
            rows = widest if shape.layer_kv_heads else shape.kv_heads_of(i)
            cache = torch.full((2, num_blocks, block_size, *rows), float("nan"), dtype=param.dtype, device=param.device)
            self.kv_caches.append(narrow_kv_view(cache, *shape.kv_heads_of(i)) if rows != shape.kv_heads_of(i) else cache)
        for layer, source in shape.kv_shared_layers:  # a layer reading another's KV gets its cache
            self.kv_caches[layer] = self.kv_caches[source]
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.blocks: dict[int, list[int]] = {}
        self.num_tokens: dict[int, int] = {}

    @torch.no_grad()
    def step(self, chunks: list[tuple[int, list[int]]]) -> torch.Tensor:
        """Feed each (seq_id, new token ids) chunk; returns float32 logits for every new token."""
        device = next(self.model.parameters()).device
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        for seq_id, tokens in chunks:
            done = self.num_tokens.get(seq_id, 0)
            blocks = self.blocks.setdefault(seq_id, [])
            for pos in range(done, done + len(tokens)):
                if pos // self.block_size >= len(blocks):
                    blocks.append(self.free_blocks.pop())
                positions.append(pos)
                slots.append(blocks[pos // self.block_size] * self.block_size + pos % self.block_size)
            input_ids.extend(tokens)
            self.num_tokens[seq_id] = done + len(tokens)
            starts.append(starts[-1] + len(tokens))
            seq_lens.append(done + len(tokens))
            tables.append(list(blocks))
        width = max(len(t) for t in tables) + 1
        block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)
        metadata = AttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_table=block_table,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            max_query_len=max(len(t) for _, t in chunks),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=starts,
            seq_lens_cpu=seq_lens,
        )
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=device),
            torch.tensor(positions, dtype=torch.long, device=device),
            self.kv_caches,
            metadata,
        )
        return self.model.compute_logits(hidden)
