"""``pagellm bench`` end to end on the real default model, with tiny sizes."""
import json

import pytest

from pagellm.cli import main

pytestmark = pytest.mark.slow


def test_bench_compare_end_to_end(tmp_path):
    rc = main([
        "--log-level", "warning", "bench", "compare",
        "--num-prompts", "8",
        "--variable-input-min", "8", "--variable-input-max", "24",
        "--variable-output-min", "2", "--variable-output-max", "12", "--variable-output-median", "4",
        "--max-model-len", "64", "--num-kv-blocks", "16", "--block-size", "16",  # 256 tokens = 4 x max_model_len
        "--block-size-sweep", "16,32",
        "--plot", str(tmp_path / "plots"),
        "--save-result", "--result-dir", str(tmp_path), "--result-filename", "compare.json",
        "--disable-tqdm",
    ])
    assert rc == 0
    result = json.loads((tmp_path / "compare.json").read_text())
    assert result["config"]["kv_budget_tokens"] == 256
    assert result["config"]["num_prompts"] == 8
    paged, contiguous = result["designs"]
    assert (paged["kv_layout"], contiguous["kv_layout"]) == ("paged", "contiguous")
    assert contiguous["reserve"] == "max_model_len"
    expected_output = sum(result["config"]["output_lens"])
    for d in (paged, contiguous):
        for key in ("output_throughput", "request_throughput", "mean_latency_ms", "p99_latency_ms", "mean_ttft_ms",
                    "duration_s", "num_preemptions", "timeline"):
            assert key in d, key
        for key in ("mean_utilization", "peak_utilization", "max_requests_in_flight", "mean_requests_in_flight"):
            assert key in d["utilization"], key
        assert d["num_requests"] == 8
        assert d["total_output_tokens"] == expected_output
        assert d["kv_budget_tokens"] == 256
        assert len(d["timeline"]["time_s"]) == d["num_steps"]
        assert max(d["timeline"]["num_reserved_tokens"]) <= 256
    # Each contiguous request reserves a whole 64-token slab: at most 4 fit in 256 tokens.
    assert contiguous["utilization"]["max_requests_in_flight"] <= 4
    assert contiguous["num_preemptions"] == 0
    assert paged["utilization"]["max_requests_in_flight"] >= contiguous["utilization"]["max_requests_in_flight"]
    assert paged["utilization"]["mean_utilization"] >= contiguous["utilization"]["mean_utilization"]
    assert 0 < paged["utilization"]["mean_utilization"] <= 1
    assert set(result["ratios"]) == {"contiguous"}
    sweep = result["block_size_sweep"]
    assert [p["block_size"] for p in sweep] == [16, 32]
    assert [p["num_blocks"] for p in sweep] == [16, 8]  # same budget in tokens
    for name in ("kv_utilization.png", "throughput_latency.png", "block_size_sweep.png"):
        assert (tmp_path / "plots" / name).stat().st_size > 1000


def test_bench_throughput_and_latency_end_to_end(tmp_path, capsys):
    rc = main([
        "--log-level", "warning", "bench", "throughput", "--num-prompts", "3", "--input-len", "8", "--output-len", "4",
        "--max-model-len", "64", "--num-kv-blocks", "16", "--disable-tqdm",
        "--save-result", "--result-dir", str(tmp_path), "--result-filename", "tp.json",
    ])
    assert rc == 0
    tp = json.loads((tmp_path / "tp.json").read_text())
    assert tp["num_requests"] == 3
    assert tp["total_output_tokens"] == 12  # ignore_eos: exactly as asked
    assert tp["total_num_tokens"] == 3 * 8 + 12
    assert tp["output_tokens_per_second"] == pytest.approx(12 / tp["elapsed_time"])
    assert "Throughput:" in capsys.readouterr().out

    rc = main([
        "--log-level", "warning", "bench", "latency", "--batch-size", "2", "--input-len", "8", "--output-len", "3",
        "--num-iters-warmup", "0", "--num-iters", "2", "--max-model-len", "64", "--num-kv-blocks", "16", "--disable-tqdm",
        "--save-result", "--result-dir", str(tmp_path), "--result-filename", "lat.json",
    ])
    assert rc == 0
    lat = json.loads((tmp_path / "lat.json").read_text())
    assert len(lat["latencies"]) == 2
    assert lat["avg_latency"] == pytest.approx(sum(lat["latencies"]) / 2)
    assert set(lat["percentiles"]) == {"10", "25", "50", "75", "90", "99"}
    assert "Avg latency:" in capsys.readouterr().out
