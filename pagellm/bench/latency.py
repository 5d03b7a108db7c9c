"""``pagellm bench latency``: how long one fixed batch takes from submission to its last token.

    pagellm bench latency --batch-size 8 --input-len 32 --output-len 128 --num-iters 10

The same batch of prompts (random token ids, or ``--dataset-name grounded``: chat requests that
copy from a passage, pagellm.bench.grounded) is generated ``--num-iters-warmup`` times untimed,
then ``--num-iters`` times timed; the report gives the average and percentiles of those runs, as
``vllm bench latency`` does, and output tokens per second. Under ``--speculative-config`` it adds
the drafts' acceptance over the timed runs.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import replace

import numpy as np
from tqdm.auto import tqdm

from pagellm.bench.common import add_result_args, save_result
from pagellm.bench.compare import bench_sampling_params
from pagellm.bench.datasets import check_fits, random_dataset, tokenizer_token_ids
from pagellm.bench.grounded import grounded_dataset

PERCENTILES = (10, 25, 50, 75, 90, 99)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    from pagellm.cli import add_engine_args

    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-iters-warmup", type=int, default=2)
    parser.add_argument("--num-iters", type=int, default=10)
    parser.add_argument("--dataset-name", choices=["random", "grounded"], default="random")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (vLLM's benchmarks: 1.0; 0: greedy)")
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
    tokenizer = llm.llm_engine.tokenizer
    if args.dataset_name == "grounded":
        samples = grounded_dataset(args.batch_size, args.input_len, args.output_len, tokenizer, seed=args.seed)
    else:
        samples = random_dataset(args.batch_size, args.input_len, args.output_len, tokenizer_token_ids(tokenizer), seed=args.seed)
    check_fits(samples, llm.llm_engine.max_model_len)
    prompts = [{"prompt_token_ids": s.prompt_token_ids} for s in samples]
    params = replace(bench_sampling_params(args.output_len), temperature=args.temperature)
    scheduler = llm.llm_engine.core.scheduler

    def run_once() -> float:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    for _ in tqdm(range(args.num_iters_warmup), desc="Warmup iterations", disable=args.disable_tqdm):
        run_once()
    spec_before = scheduler.stats().spec_decoding
    latencies = [run_once() for _ in tqdm(range(args.num_iters), desc="Profiling iterations", disable=args.disable_tqdm)]
    result = latency_result(latencies)
    result["output_tokens_per_s"] = args.batch_size * args.output_len / result["avg_latency"]
    print(f"Avg latency: {result['avg_latency']:.4f} seconds")
    for p, value in result["percentiles"].items():
        print(f"{p}% percentile latency: {value:.4f} seconds")
    print(f"Output tokens/s: {result['output_tokens_per_s']:.2f}")
    if spec_before is not None:
        spec = scheduler.stats().spec_decoding.since(spec_before)
        result["spec_decoding"] = spec.to_dict()
        print(
            f"Speculative decoding: {spec.num_drafts} verifications, {spec.acceptance_rate:.1%} of "
            f"{spec.num_draft_tokens} drafts accepted, {spec.mean_acceptance_length:.2f} tokens per verification"
        )
    save_result(result, args, "latency")
    return 0
