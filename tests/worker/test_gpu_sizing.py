"""KV cache sizing from GPU memory (--gpu-memory-utilization) and --dtype auto, with no GPU needed."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from pagellm.cli import add_engine_args, engine_kwargs
from pagellm.config import EngineConfig, model_dtype
from pagellm.worker.kv_cache import activation_reserve_bytes, gpu_kv_cache_budget

GiB = 2**30


def test_budget_is_the_allowed_share_minus_what_is_used() -> None:
    # 100 GiB device, 10 GiB in use (weights, other processes): 90 allowed - 10 used - 2 reserved.
    assert gpu_kv_cache_budget(0.9, 2 * GiB, lambda: (90 * GiB, 100 * GiB)) == 78 * GiB
    assert gpu_kv_cache_budget(0.5, 0, lambda: (100 * GiB, 100 * GiB)) == 50 * GiB


def test_no_room_left_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="raise gpu_memory_utilization"):
        gpu_kv_cache_budget(0.3, GiB, lambda: (60 * GiB, 100 * GiB))


def test_activation_reserve_grows_with_the_batch() -> None:
    small = activation_reserve_bytes(256, 16, 576, 1536, 49152, 2)
    big = activation_reserve_bytes(8192, 256, 576, 1536, 49152, 2)
    assert 256 * 2**20 < small < big < 2 * GiB


def test_bad_utilization_is_a_value_error() -> None:
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            EngineConfig(gpu_memory_utilization=bad, device="cpu")


def test_dtype_auto_is_float32_on_cpu_and_the_models_on_gpu() -> None:
    from pagellm.models.precision import resolve_precision

    def dtypes(**kwargs):
        resolved = resolve_precision(EngineConfig(**kwargs), torch.bfloat16, False)
        return resolved.dtype, resolved.kv_cache_dtype

    assert dtypes(device="cpu", dtype="float32") == (torch.float32, torch.float32)
    assert dtypes(device="cuda") == (torch.bfloat16, torch.bfloat16)  # no allocation: the device is only named
    assert dtypes(device="cuda", dtype="float32", kv_cache_dtype="auto") == (torch.float32, torch.float32)
    assert dtypes(device="cuda", kv_cache_dtype="float16") == (torch.bfloat16, torch.float16)


def test_model_dtype_from_config() -> None:
    assert model_dtype(LlamaConfig(dtype="bfloat16")) == torch.bfloat16
    assert model_dtype(LlamaConfig(dtype="float32")) == torch.float32
    assert model_dtype(object()) == torch.bfloat16  # e.g. a config rebuilt from a quantized GGUF


def test_gpu_flags() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    defaults = engine_kwargs(parser.parse_args([]))
    assert defaults["dtype"] == "auto" and defaults["gpu_memory_utilization"] == 0.9 and not defaults["enforce_eager"]
    kwargs = engine_kwargs(parser.parse_args(["--gpu-memory-utilization", "0.5", "--enforce-eager", "--device", "cpu"]))
    config = EngineConfig(**kwargs)
    assert config.gpu_memory_utilization == 0.5 and config.enforce_eager and config.dtype == "auto"
