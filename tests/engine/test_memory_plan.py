"""The memory plan: estimated before loading, measured after, refused when it cannot fit."""
from __future__ import annotations

import os

import pytest

from pagellm import LLM
from pagellm.config import EXACT_LINEAR, LinearPrecision
from pagellm.kernels import ops
from pagellm.models.loader import default_model_path
from pagellm.plan.memory_plan import GiB, MemoryPlan, available_memory_bytes, estimate_weight_bytes


def test_a_plan_that_does_not_fit_names_its_parts() -> None:
    plan = MemoryPlan(
        checkpoint_bytes=4 << 30, weight_bytes=5 << 30, kv_cache_bytes=20 << 30, activation_bytes=1 << 30, available_bytes=16 << 30
    )
    with pytest.raises(ValueError, match=r"does not fit in memory: weights 5\.00 GiB \(checkpoint 4\.00 GiB\), KV cache 20\.00 GiB"):
        plan.check()
    MemoryPlan(4 << 30, 5 << 30, 2 << 30, 1 << 30, 16 << 30).check()
    MemoryPlan(4 << 30, 5 << 30, 20 << 30, 1 << 30, None).check()  # unknown (a GPU): not checked here


def test_available_memory_is_read_from_the_machine() -> None:
    available = available_memory_bytes()
    assert available is not None and 0 < available <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def test_the_estimate_follows_the_form_of_each_layer() -> None:
    path = default_model_path()
    file_bytes, exact = estimate_weight_bytes([path], EXACT_LINEAR, True)
    assert 0.95 * os.path.getsize(path) < file_bytes <= os.path.getsize(path)  # the tensors, not the vocabulary
    assert exact > 8 * file_bytes  # float32 weights and their panels from 4.5-bit blocks
    _, blocks = estimate_weight_bytes([path], LinearPrecision(kind="int8", fallback="bfloat16"), True)
    if ops.int8_matmul_available():
        assert file_bytes < blocks < 1.6 * file_bytes  # the blocks, and the tied head's packed copy


def test_a_kv_cache_larger_than_the_machine_is_refused_before_loading() -> None:
    too_much = int((available_memory_bytes() or 1 << 40) * 2)
    with pytest.raises(ValueError, match="does not fit in memory"):
        LLM(kv_cache_memory_bytes=too_much)


def test_the_engine_reports_its_measured_plan() -> None:
    llm = LLM(kv_cache_memory_bytes=64 << 20)
    plan = llm.llm_engine.memory_plan
    assert plan.kv_cache_bytes <= 64 << 20 and plan.kv_cache_tokens > 0
    assert plan.weight_bytes == llm.llm_engine.model.weight_bytes()
    assert plan.weight_bytes < 2 * os.path.getsize(default_model_path()) or not ops.int8_matmul_available()
    assert "GiB" in plan.describe() and plan.total_bytes < 4 * GiB
