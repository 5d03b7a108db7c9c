"""EngineConfig resolves and validates what users pass, as the CLI passes it."""
from __future__ import annotations

import argparse

import pytest
import torch

from pagellm.cli import add_engine_args, engine_kwargs
from pagellm.config import EngineConfig
from pagellm.worker.kv_cache import bytes_per_block


@pytest.mark.parametrize(
    ("dtype", "kv_cache_dtype", "expected"),
    [
        ("float32", "auto", "auto"),  # decided with the model and the machine (tests/models/test_precision.py)
        ("bfloat16", "auto", "auto"),
        ("float32", "float16", torch.float16),
        ("float32", "fp16", torch.float16),
        ("float32", "bfloat16", torch.bfloat16),
        ("float32", torch.float16, torch.float16),
    ],
)
def test_kv_cache_dtype_resolves(dtype, kv_cache_dtype, expected) -> None:
    config = EngineConfig(dtype=dtype, kv_cache_dtype=kv_cache_dtype, device="cpu")
    assert config.kv_cache_dtype == expected


@pytest.mark.parametrize(
    ("name", "expected"),
    [("fp8", torch.float8_e4m3fn), ("FP8_E4M3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2), ("int8", torch.int8)],
)
def test_eight_bit_kv_cache_dtypes_take_vllms_names(name, expected) -> None:
    assert EngineConfig(kv_cache_dtype=name, device="cpu").kv_cache_dtype == expected
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    kwargs = engine_kwargs(parser.parse_args(["--kv-cache-dtype", name, "--calculate-kv-scales"]))
    assert kwargs["kv_cache_dtype"] == name and kwargs["calculate_kv_scales"] is True


def test_bad_kv_cache_dtype_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="unsupported kv_cache_dtype 'int7'; choose auto"):
        EngineConfig(kv_cache_dtype="int7", device="cpu")


def test_cli_flag_reaches_the_config() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args([]))["kv_cache_dtype"] == "auto"
    config = EngineConfig(**engine_kwargs(parser.parse_args(["--kv-cache-dtype", "float16", "--device", "cpu"])))
    assert config.kv_cache_dtype == torch.float16 and config.dtype == "auto"


def test_half_precision_blocks_take_half_the_bytes() -> None:
    # SmolLM2-135M: 30 layers, 3 kv heads of 64; a 16-token block is 737,280 bytes in float32.
    assert bytes_per_block(30, 16, 3, 64, torch.float32) == 737_280
    assert bytes_per_block(30, 16, 3, 64, torch.float16) == 368_640
    assert bytes_per_block(30, 16, 3, 64, torch.bfloat16) == 368_640


def test_runner_task_and_pooler_config():
    from pagellm.pooling_params import PoolerConfig

    assert EngineConfig().runner == "generate" and EngineConfig().pooler_config is None
    config = EngineConfig(runner="pooling")
    assert config.is_pooling and config.pooler_config == PoolerConfig("LAST", True) and config.enable_prefix_caching
    assert EngineConfig(task="embed").is_pooling
    mean = EngineConfig(runner="pooling", pooler_config='{"pooling_type": "mean", "normalize": false}')
    assert mean.pooler_config == PoolerConfig("MEAN", False)
    assert not mean.enable_prefix_caching  # MEAN reads positions a cache hit skips
    assert not EngineConfig(runner="pooling", pooler_config={"pooling_type": "CLS"}).enable_prefix_caching
    for bad, match in [
        (dict(runner="embed"), "unsupported runner"),
        (dict(task="classify"), "unsupported task"),
        (dict(task="embed", runner="generate"), "asks for runner"),
        (dict(pooler_config={"pooling_type": "LAST"}), "needs runner='pooling'"),
        (dict(runner="pooling", pooler_config={"pooling_type": "MAX"}), "unsupported pooling_type"),
        (dict(runner="pooling", pooler_config={"normalise": True}), "unsupported pooler_config keys"),
        (dict(runner="pooling", pooler_config="{not json"), "not valid JSON"),
        (dict(runner="pooling", speculative_config={"method": "ngram", "num_speculative_tokens": 2}), "speculative_config"),
    ]:
        with pytest.raises(ValueError, match=match):
            EngineConfig(**bad)


def test_pooling_params_validation():
    from pagellm.pooling_params import PoolerConfig, PoolingParams

    for bad in (dict(dimensions=0), dict(dimensions=True), dict(dimensions=2.5), dict(normalize="yes")):
        with pytest.raises(ValueError):
            PoolingParams(**bad)
    assert PoolingParams().resolved(PoolerConfig(), 576) == PoolingParams(dimensions=576, normalize=True)
    assert PoolingParams(dimensions=8, normalize=False).resolved(PoolerConfig(), 576) == PoolingParams(8, False)
    with pytest.raises(ValueError, match="between 1 and"):
        PoolingParams(dimensions=577).resolved(PoolerConfig(), 576)


def test_lora_settings_are_checked():
    config = EngineConfig(enable_lora=True, max_loras=3, device="cpu")
    assert config.max_cpu_loras == 3 and config.lora_dtype == "auto" and config.max_lora_rank == 16
    assert EngineConfig(lora_dtype="bfloat16", device="cpu").lora_dtype == torch.bfloat16
    # auto follows the linear layers: bfloat16 slots under int8/bf16 products, float32 on the exact path.
    from pagellm.config import EXACT_LINEAR, LinearPrecision
    from pagellm.kernels import ops
    from pagellm.models.precision import resolve_precision

    int8_bf16 = LinearPrecision("int8", "bfloat16")
    fast = ops.int8_matmul_available() and ops.bf16_matmul_available()
    for dtype, precision in (("auto", int8_bf16 if fast else EXACT_LINEAR), ("float32", EXACT_LINEAR)):
        resolved = resolve_precision(EngineConfig(enable_lora=True, device="cpu", dtype=dtype), torch.bfloat16, True)
        assert resolved.linear == precision
        assert resolved.lora_dtype == (torch.float32 if precision.exact else torch.bfloat16)
    chosen = EngineConfig(enable_lora=True, device="cpu", lora_dtype="float32")
    assert resolve_precision(chosen, torch.bfloat16, True).lora_dtype == torch.float32
    for kwargs, message in [
        (dict(max_loras=0), "max_loras"),
        (dict(max_lora_rank=-1), "max_lora_rank"),
        (dict(max_loras=4, max_cpu_loras=2), "max_cpu_loras"),
        (dict(lora_dtype="float16"), "lora_dtype"),
        (dict(enable_lora=True, runner="pooling"), "generate runner"),
    ]:
        with pytest.raises(ValueError, match=message):
            EngineConfig(device="cpu", **kwargs)


def test_lora_flags_reach_the_config():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    flags = ["--enable-lora", "--max-loras", "4", "--max-lora-rank", "8", "--max-cpu-loras", "6", "--lora-dtype", "bfloat16"]
    config = EngineConfig(**engine_kwargs(parser.parse_args([*flags, "--device", "cpu"])))
    assert (config.enable_lora, config.max_loras, config.max_lora_rank, config.max_cpu_loras) == (True, 4, 8, 6)
    assert config.lora_dtype == torch.bfloat16


def test_mamba_ssm_cache_dtype_is_resolved_and_checked():
    from pagellm.models.precision import resolve_precision

    assert EngineConfig(device="cpu").mamba_ssm_cache_dtype == "auto"
    # auto keeps the recurrent matrices in float32 whatever the model computes in.
    for dtype in ("auto", "float32", "bfloat16"):
        assert resolve_precision(EngineConfig(device="cpu", dtype=dtype), torch.bfloat16, True).ssm_state_dtype == torch.float32
    chosen = EngineConfig(device="cpu", mamba_ssm_cache_dtype="bfloat16")
    assert chosen.mamba_ssm_cache_dtype == torch.bfloat16
    assert resolve_precision(chosen, torch.bfloat16, True).ssm_state_dtype == torch.bfloat16
    for bad in ("float16", "fp8", "banana"):
        with pytest.raises(ValueError, match="mamba_ssm_cache_dtype must be auto, float32 or bfloat16"):
            EngineConfig(device="cpu", mamba_ssm_cache_dtype=bad)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = EngineConfig(**engine_kwargs(parser.parse_args(["--mamba-ssm-cache-dtype", "bfloat16", "--device", "cpu"])))
    assert config.mamba_ssm_cache_dtype == torch.bfloat16
    with pytest.raises(SystemExit):
        parser.parse_args(["--mamba-ssm-cache-dtype", "float16"])


def test_mamba_cache_dtype_sets_the_convolution_tails_and_the_default_for_the_matrices():
    from pagellm.models.precision import resolve_precision

    def states(**kw):
        precision = resolve_precision(EngineConfig(device="cpu", dtype="float32", **kw), torch.bfloat16, True)
        return precision.conv_state_dtype, precision.ssm_state_dtype

    assert states() == (torch.float32, torch.float32)  # tails in the activations' dtype, matrices float32
    assert states(mamba_cache_dtype="bfloat16") == (torch.bfloat16, torch.bfloat16)
    assert states(mamba_cache_dtype="bfloat16", mamba_ssm_cache_dtype="float32") == (torch.bfloat16, torch.float32)
    assert states(mamba_cache_dtype="float32", mamba_ssm_cache_dtype="bfloat16") == (torch.float32, torch.bfloat16)
    with pytest.raises(ValueError, match="mamba_cache_dtype must be auto, float32 or bfloat16, got 'float16'"):
        EngineConfig(device="cpu", mamba_cache_dtype="float16")
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = EngineConfig(**engine_kwargs(parser.parse_args(["--mamba-cache-dtype", "bfloat16", "--device", "cpu"])))
    assert (config.mamba_cache_dtype, config.mamba_ssm_cache_dtype) == (torch.bfloat16, "auto")


def test_vllms_trust_remote_code_and_language_model_only_are_taken():
    """Copied from vLLM's commands and code, they run: neither changes what pagellm loads."""
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    kwargs = engine_kwargs(parser.parse_args(["--trust-remote-code", "--language-model-only", "--device", "cpu"]))
    config = EngineConfig(**kwargs)
    assert (config.trust_remote_code, config.language_model_only) == (True, True)
    assert engine_kwargs(parser.parse_args([]))["trust_remote_code"] is False


def test_mamba_block_size_is_vllms_name_for_the_checkpoint_interval():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args([]))["state_checkpoint_interval"] == 256
    for flag in ("--mamba-block-size", "--state-checkpoint-interval"):
        assert engine_kwargs(parser.parse_args([flag, "512"]))["state_checkpoint_interval"] == 512


def test_flags_take_vllms_underscore_spelling() -> None:
    from pagellm.cli import build_parser, dashed_flags

    argv = dashed_flags(
        ["serve", "m.gguf", "--max_model_len", "512", "--mamba_ssm_cache_dtype=bfloat16", "--enable-prefix-caching",
         "--served_model_name", "my_model"]
    )
    assert argv == ["serve", "m.gguf", "--max-model-len", "512", "--mamba-ssm-cache-dtype=bfloat16",
                    "--enable-prefix-caching", "--served-model-name", "my_model"]
    args = build_parser(argv).parse_args(argv)
    assert (args.max_model_len, args.mamba_ssm_cache_dtype, args.served_model_name) == (512, "bfloat16", "my_model")
    # A value, and anything after a bare "--", is left as written.
    assert dashed_flags(["generate", "a_b", "--", "--x_y"]) == ["generate", "a_b", "--", "--x_y"]


def test_command_line_imports_only_the_subcommand_it_runs() -> None:
    """``pagellm serve`` does not import the benchmarks (their HTTP client) to build its parser."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from pagellm.cli import build_parser\n"
        "args = build_parser(['--log-level', 'debug', 'serve', 'm.gguf']).parse_args(['--log-level', 'debug', 'serve', 'm.gguf'])\n"
        "print(args.command, 'pagellm.bench.cli' in sys.modules, 'httpx' in sys.modules)\n"
        "print(sorted(build_parser()._subparsers._group_actions[0].choices))\n"
    )
    lines = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert lines == ["serve False False", "['bench', 'chat', 'generate', 'serve']"]
