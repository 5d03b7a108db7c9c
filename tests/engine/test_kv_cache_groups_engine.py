"""The engine core over KV cache groups, with a stand-in model: the same budget buys a hybrid
model more blocks, a request's KV is read back in blocks and bytes, the contiguous baseline sees
one full-attention group, and the context cap follows what one request can hold."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from pagellm.config import EngineConfig
from pagellm.engine.engine_core import EngineCore
from pagellm.executor.base import UniProcExecutor
from pagellm.executor.worker import Worker
from pagellm.models.shape import ModelShape
from pagellm.plan.resolved_config import ModelSpec, resolve_with_model
from pagellm.sampling_params import SamplingParams
from pagellm.worker.kv_cache import bytes_per_block

GEMMA3_6 = (512, 512, 512, 512, 512, None)


class ConstantModel(torch.nn.Module):
    """Always predicts token 5; records the metadata each forward got."""

    def __init__(self) -> None:
        super().__init__()
        self.metadata: list[object] = []

    def forward(self, input_ids, positions, kv_caches, attn_metadata):
        self.metadata.append(attn_metadata)
        return torch.zeros(len(input_ids), 2)

    def compute_logits(self, hidden):
        logits = torch.zeros(len(hidden), 32)
        logits[:, 5] = 1.0
        return logits


def shape(windows) -> ModelShape:
    return ModelShape(num_layers=len(windows), num_kv_heads=1, head_dim=16, vocab_size=32, layer_sliding_windows=tuple(windows))


def core_for(config: EngineConfig, windows, max_model_len: int, kv_cache_manager: str = "paged") -> EngineCore:
    """An engine core over the stand-in model, resolved as a checkpoint of this shape would be."""
    model = ModelSpec("", SimpleNamespace(hidden_size=32, intermediate_size=64), shape(windows), torch.float32, False)
    resolved = resolve_with_model(config, model, max_model_len=max_model_len)
    return EngineCore(resolved, UniProcExecutor(Worker(resolved, model=ConstantModel())), kv_cache_manager)


def engine(windows, kv_bytes: int = 4 << 20, max_model_len: int = 8192, **kw) -> EngineCore:
    config = EngineConfig(kv_cache_memory_bytes=kv_bytes, block_size=16, max_num_batched_tokens=1024, **kw)
    return core_for(config, windows, max_model_len)


def run_request(core: EngineCore, num_prompt: int, max_tokens: int, watch_at: int):
    core.add_request(core.make_request("a", [3] * num_prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens), max_tokens))
    usage = None
    while core.has_unfinished_requests():
        core.step()
        request = core.scheduler.requests.get("a")
        if request is not None and request.num_computed_tokens == watch_at:
            usage = core.request_kv_usage("a")
            stats = core.stats().scheduler
            assert stats.num_block_table_entries == usage.num_blocks
    return usage


def test_the_same_budget_buys_a_hybrid_model_six_times_the_blocks():
    full, hybrid = engine([None] * 6), engine(GEMMA3_6)
    one_layer = bytes_per_block(1, 16, 1, 16, torch.float32)
    assert full.kv_block_bytes == 6 * one_layer and hybrid.kv_block_bytes == one_layer
    assert (full.num_blocks, hybrid.num_blocks) == ((4 << 20) // (6 * one_layer), (4 << 20) // one_layer)
    assert full.kv_cache_bytes <= 4 << 20 and hybrid.kv_cache_bytes <= 4 << 20
    # Tokens of full context: the usable blocks (less the null block) shared by the six groups.
    assert hybrid.kv_cache_tokens == (hybrid.num_blocks - 1) // 6 * 16 and full.kv_cache_tokens == full.num_blocks * 16
    assert hybrid.kv_cache_layout.num_groups == 6 and full.kv_cache_layout.plain


def test_a_request_at_4096_tokens_holds_about_a_sixth():
    full = run_request(engine([None] * 6), 4095, 3, watch_at=4096)
    hybrid_core = engine(GEMMA3_6)
    hybrid = run_request(hybrid_core, 4095, 3, watch_at=4096)
    assert full.num_blocks == 256 and full.num_bytes == 256 * 6 * bytes_per_block(1, 16, 1, 16, torch.float32)
    assert hybrid.num_blocks == 256 + 5 * 32 and hybrid.num_bytes == 416 * bytes_per_block(1, 16, 1, 16, torch.float32)
    assert hybrid.num_bytes / full.num_bytes == pytest.approx(416 / 1536)
    # Each layer got its own group's metadata; all blocks came back at the end.
    per_layer = hybrid_core.runner.model.metadata[-1]
    assert isinstance(per_layer, list) and len(per_layer) == 6 and len({id(m) for m in per_layer}) == 6
    assert hybrid_core.kv_cache_manager.block_pool.num_used_blocks == 0
    hybrid_core.kv_cache_manager.check_integrity()


def test_a_full_attention_model_gets_todays_arguments():
    core = engine([None, None])
    run_request(core, 20, 2, watch_at=20)
    assert all(not isinstance(md, list) for md in core.runner.model.metadata)
    assert core.kv_cache_manager.block_pool.null_block is None and core.kv_cache_manager.num_kv_cache_groups == 1


def test_the_contiguous_baseline_keeps_whole_contexts_in_one_group():
    import pagellm.bench.baseline  # noqa: F401  (registers "contiguous")

    config = EngineConfig(kv_cache_memory_bytes=4 << 20, block_size=16)
    core = core_for(config, GEMMA3_6, 2048, kv_cache_manager="contiguous")
    assert core.kv_cache_layout.plain and core.kv_block_bytes == bytes_per_block(6, 16, 1, 16, torch.float32)


def test_the_context_is_capped_by_what_one_request_can_hold(caplog):
    one_layer = bytes_per_block(1, 16, 1, 16, torch.float32)
    # 4096 tokens: the null block, 256 full-attention blocks, 5 windows of cdiv(511 + 1024, 16) + 1.
    budget = (1 + 256 + 5 * 97) * one_layer
    assert engine(GEMMA3_6, kv_bytes=budget, max_model_len=4096).max_model_len == 4096
    with caplog.at_level(logging.WARNING):
        assert engine(GEMMA3_6, kv_bytes=budget - one_layer, max_model_len=4096).max_model_len == 4080
    config = EngineConfig(kv_cache_memory_bytes=budget - one_layer, block_size=16, max_model_len=4096)
    with pytest.raises(ValueError, match=r"does not fit in the KV cache, which holds 4080 tokens \(741 blocks of 16, 6 groups"):
        core_for(config, GEMMA3_6, 4096)
