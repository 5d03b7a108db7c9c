"""Which arithmetic the linear layers use, resolved from --dtype, --quantization, the model and the CPU."""
from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from pagellm.config import EngineConfig, LinearPrecision
from pagellm.kernels import ops
from pagellm.models.precision import ResolvedPrecision, resolve_precision


@pytest.fixture
def cpu_has(monkeypatch):
    def set_features(bf16: bool, int8: bool) -> None:
        monkeypatch.setattr(ops, "bf16_matmul_available", lambda: bf16)
        monkeypatch.setattr(ops, "int8_matmul_available", lambda: int8)

    return set_features


def resolve(is_gguf: bool = True, checkpoint: torch.dtype = torch.bfloat16, **kwargs) -> tuple[LinearPrecision, ResolvedPrecision]:
    resolved = resolve_precision(EngineConfig(device="cpu", **kwargs), checkpoint, is_gguf)
    return resolved.linear, resolved


def test_auto_on_a_gguf_model_takes_int8_blocks_and_a_bfloat16_cache(cpu_has) -> None:
    cpu_has(bf16=True, int8=True)
    precision, config = resolve()
    assert precision == LinearPrecision(kind="int8", fallback="bfloat16") and not precision.exact
    assert config.dtype == torch.float32 and config.kv_cache_dtype == torch.bfloat16
    # an explicit cache dtype is kept
    assert resolve(kv_cache_dtype="float32")[1].kv_cache_dtype == torch.float32


def test_float32_asks_for_the_exact_path_unless_gguf_is_asked_for_too(cpu_has) -> None:
    cpu_has(bf16=True, int8=True)
    precision, config = resolve(dtype="float32")
    assert precision.exact and config.kv_cache_dtype == torch.float32
    precision, config = resolve(dtype="float32", quantization="gguf")
    assert precision == LinearPrecision(kind="int8", fallback="float32")
    assert config.kv_cache_dtype == torch.bfloat16


def test_bfloat16_on_a_cpu_keeps_float32_tensors(cpu_has) -> None:
    cpu_has(bf16=True, int8=True)
    precision, config = resolve(dtype="bfloat16")
    assert precision == LinearPrecision(kind="bfloat16", fallback="bfloat16")
    assert config.dtype == torch.float32 and config.kv_cache_dtype == torch.bfloat16
    # a float checkpoint: its own dtype under auto, no blocks
    assert resolve(is_gguf=False)[0] == LinearPrecision("bfloat16", "bfloat16")
    assert resolve(is_gguf=False, checkpoint=torch.float32)[0].exact


def test_cpus_without_the_instructions_fall_back_to_float32(cpu_has, caplog) -> None:
    cpu_has(bf16=False, int8=False)
    assert resolve()[0].exact
    with caplog.at_level(logging.WARNING, logger="pagellm.models.precision"):
        precision, config = resolve(dtype="bfloat16", quantization="gguf")
    assert precision.exact and config.dtype == torch.float32 and config.kv_cache_dtype == torch.float32
    assert "AVX512_BF16" in caplog.text and "int8 dot products" in caplog.text
    cpu_has(bf16=False, int8=True)  # int8 without AVX512_BF16 (an AVX2 or AVX-VNNI core)
    assert resolve()[0] == LinearPrecision(kind="int8", fallback="float32")


def test_bad_quantization_and_other_devices(cpu_has) -> None:
    cpu_has(bf16=True, int8=True)
    with pytest.raises(ValueError, match="choose one of"):
        EngineConfig(device="cpu", quantization="awq")
    with pytest.raises(ValueError, match="GGUF model"):
        resolve(is_gguf=False, quantization="gguf")
    gpu = resolve_precision(EngineConfig(device="cuda"), torch.bfloat16, True)
    assert gpu.linear.exact and gpu.dtype == torch.bfloat16 and gpu.kv_cache_dtype == torch.bfloat16


def test_resolving_leaves_the_users_config_as_it_was(cpu_has) -> None:
    cpu_has(bf16=True, int8=True)
    config = EngineConfig(device="cpu")
    resolved = resolve_precision(config, torch.bfloat16, True)
    assert resolved.kv_cache_dtype == torch.bfloat16 and resolved.lora_dtype == torch.bfloat16
    assert (config.dtype, config.kv_cache_dtype, config.lora_dtype) == ("auto", "auto", "auto")
    # a copy keeps what was asked for, so resolving it decides the same
    assert resolve_precision(dataclasses.replace(config, block_size=32), torch.bfloat16, True) == resolved
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.dtype = torch.bfloat16  # type: ignore[misc]
