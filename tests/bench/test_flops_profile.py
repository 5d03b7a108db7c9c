import json

import pytest

from pagellm.bench.flops import DEFAULT_MODEL_PARAMS, measure_matmul_peak, model_flop_utilization


def test_mfu_arithmetic():
    # 24,576 tokens of a 134.5M-parameter model in 47.2 s on a 140 GFLOP/s machine: ~100%.
    mfu = model_flop_utilization(24_576, 2 * DEFAULT_MODEL_PARAMS * 24_576 / 140e9, 140.0)
    assert mfu == pytest.approx(1.0)
    assert model_flop_utilization(1000, 10.0, 100.0, params=1e9) == pytest.approx(2.0)
    with pytest.raises(ValueError):
        model_flop_utilization(10, 0.0, 100.0)


def test_matmul_peak_is_a_positive_rate():
    assert measure_matmul_peak(size=128, seconds=0.05) > 0


@pytest.mark.slow
def test_profile_and_prefix_cache_commands_run(capsys):
    from pagellm.cli import main

    assert main(["--log-level", "warning", "bench", "profile", "--batch-size", "4", "--input-len", "16", "--num-steps", "4"]) == 0
    out = capsys.readouterr().out
    for label in ("matrix multiplies", "attention", "sampling", "input preparation", "scheduling"):
        assert label in out
    assert main(["--log-level", "warning", "bench", "prefix-cache", "--num-prompts", "6", "--num-prefixes", "2",
                 "--prefix-len", "32", "--suffix-len", "8", "--output-len", "2"]) == 0
    out = capsys.readouterr().out
    assert "Cache hits: 128 of ideal 128 (100.0%)" in out  # (6 - 2) requests x 32 prefix tokens


def test_mfu_command_rates_against_the_higher_peak(tmp_path, capsys):
    from pagellm.cli import main

    result = tmp_path / "r.json"
    # 1,000 tokens in 1 s: 269 GFLOP/s of model work.
    result.write_text(json.dumps({"total_input_tokens": 600, "total_output_tokens": 400, "duration": 1.0}))
    args = ["--log-level", "warning", "bench", "mfu", "--seconds", "0.2", "--result", str(result)]
    assert main(args + ["--peak-floor", "1e6"]) == 0
    out = capsys.readouterr().out
    assert "rated against the higher peak given: 1000000.0 GFLOP/s" in out
    assert "1000 tokens in 1.0 s = 269.0 GFLOP/s, MFU 0.0%" in out
    assert main(args) == 0  # no floor: the measured peak, a real rate
    assert "rated against" not in capsys.readouterr().out
