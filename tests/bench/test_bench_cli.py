import pytest

from pagellm.bench.common import positive_int_list
from pagellm.bench.compare_cmd import parse_reserve_modes
from pagellm.bench.latency import latency_result
from pagellm.bench.throughput import throughput_result
from pagellm.cli import build_parser


def test_bench_subcommands_parse():
    parser = build_parser()
    args = parser.parse_args(["bench", "compare", "--block-size-sweep", "8,16", "--plot", "out"])
    assert args.dataset_name == "variable"  # compare's default workload
    assert args.max_model_len == 2048
    assert args.enable_prefix_caching is False  # off unless asked: the contiguous design has none
    assert args.max_num_batched_tokens == 4096
    assert callable(args.func)
    args = parser.parse_args(["bench", "serve", "--base-url", "http://127.0.0.1:1", "--request-rate", "inf",
                              "--dataset-name", "prefix", "--prefix-len", "512", "--suffix-len", "64",
                              "--num-prefixes", "4", "--output-len", "64"])
    assert args.request_rate == float("inf") and args.num_prefixes == 4 and args.prompt_format == "ids"
    args = parser.parse_args(["bench", "throughput", "--dataset-name", "random", "--random-range-ratio", "0.5"])
    assert args.enable_prefix_caching is True  # other benchmarks keep the engine's defaults
    args = parser.parse_args(["bench", "latency", "--batch-size", "4"])
    assert (args.batch_size, args.num_iters) == (4, 10)


def test_list_flags():
    assert positive_int_list("8,16, 512") == [8, 16, 512]
    for bad in ("", "8,x", "0"):
        with pytest.raises(ValueError):
            positive_int_list(bad)
    assert parse_reserve_modes("max-model-len,max_tokens") == ["max_model_len", "max_tokens"]
    with pytest.raises(ValueError):
        parse_reserve_modes("everything")


def test_throughput_and_latency_arithmetic():
    r = throughput_result(elapsed_s=4.0, num_requests=10, num_prompt_tokens=300, num_output_tokens=100)
    assert r["requests_per_second"] == 2.5
    assert r["tokens_per_second"] == 100.0
    assert r["output_tokens_per_second"] == 25.0
    with pytest.raises(ValueError):
        throughput_result(0.0, 1, 1, 1)
    lat = latency_result([1.0, 2.0, 3.0, 4.0])
    assert lat["avg_latency"] == 2.5
    assert lat["percentiles"]["50"] == 2.5
    assert lat["percentiles"]["90"] == pytest.approx(3.7)
    with pytest.raises(ValueError):
        latency_result([])
