"""``pagellm bench latency``: how long one fixed batch takes from submission to its last token.

    pagellm bench latency --batch-size 8 --input-len 32 --output-len 128 --num-iters 10

The same batch of random prompts is generated ``--num-iters-warmup`` times untimed, then
``--num-iters`` times timed; the report gives the average and percentiles of those runs, as
``vllm bench latency`` does.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
from tqdm.auto import tqdm

from pagellm.bench.common import add_result_args, save_result
from pagellm.bench.compare import bench_sampling_params
from pagellm.bench.datasets import check_fits, random_dataset, tokenizer_token_ids

PERCENTILES = (10, 25, 50, 75, 90, 99)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    from pagellm.cli import add_engine_args

    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-iters-warmup", type=int, default=2)
    parser.add_argument("--num-iters", type=int, default=10)
    add_engine_args(parser)
    parser.add_argument("--disable-tqdm", action="store_true")
    add_result_args(parser)


def latency_result(latencies_s: list[float]) -> dict:
    if not latencies_s:
        raise ValueError("no latencies measured")
    values = np.asarray(latencies_s, dtype=np.float64)
    return {
        "avg_latency": float(values.mean()),
        "latencies": values.tolist(),
        "percentiles": {str(p): float(np.percentile(values, p)) for p in PERCENTILES},
    }


def main(args: argparse.Namespace) -> int:
    from pagellm import LLM
    from pagellm.cli import engine_kwargs

    for name in ("batch_size", "input_len", "output_len", "num_iters"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.num_iters_warmup < 0:
        raise ValueError("--num-iters-warmup must not be negative")
    llm = LLM(**engine_kwargs(args))
    token_ids = tokenizer_token_ids(llm.llm_engine.tokenizer)
    samples = random_dataset(args.batch_size, args.input_len, args.output_len, token_ids, seed=args.seed)
    check_fits(samples, llm.llm_engine.max_model_len)
    prompts = [{"prompt_token_ids": s.prompt_token_ids} for s in samples]
    params = bench_sampling_params(args.output_len)

    def run_once() -> float:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    for _ in tqdm(range(args.num_iters_warmup), desc="Warmup iterations", disable=args.disable_tqdm):
        run_once()
    latencies = [run_once() for _ in tqdm(range(args.num_iters), desc="Profiling iterations", disable=args.disable_tqdm)]
    result = latency_result(latencies)
    print(f"Avg latency: {result['avg_latency']:.4f} seconds")
    for p, value in result["percentiles"].items():
        print(f"{p}% percentile latency: {value:.4f} seconds")
    save_result(result, args, "latency")
    return 0
