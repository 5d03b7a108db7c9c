"""``pagellm bench throughput``: offline throughput, every request submitted at once.

    pagellm bench throughput --dataset-name random --num-prompts 100 \\
        --random-input-len 256 --random-output-len 64

Reports requests/s, total tokens/s (prompt + output) and output tokens/s over the wall time of
one ``LLM.generate`` call, as ``vllm bench throughput`` does.
"""
from __future__ import annotations

import argparse
import time

from pagellm.bench.common import add_result_args, save_result
from pagellm.bench.compare import bench_sampling_params
from pagellm.bench.datasets import add_dataset_args, check_fits, get_samples, tokenizer_token_ids


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    from pagellm.cli import add_engine_args

    add_dataset_args(parser, default_name="random", default_num_prompts=100)
    add_engine_args(parser)
    parser.add_argument("--disable-tqdm", action="store_true")
    add_result_args(parser)


def throughput_result(elapsed_s: float, num_requests: int, num_prompt_tokens: int, num_output_tokens: int) -> dict:
    if elapsed_s <= 0:
        raise ValueError(f"elapsed time must be positive, got {elapsed_s}")
    total = num_prompt_tokens + num_output_tokens
    return {
        "elapsed_time": elapsed_s,
        "num_requests": num_requests,
        "total_num_tokens": total,
        "total_prompt_tokens": num_prompt_tokens,
        "total_output_tokens": num_output_tokens,
        "requests_per_second": num_requests / elapsed_s,
        "tokens_per_second": total / elapsed_s,
        "output_tokens_per_second": num_output_tokens / elapsed_s,
    }


def main(args: argparse.Namespace) -> int:
    from pagellm import LLM
    from pagellm.cli import engine_kwargs

    llm = LLM(**engine_kwargs(args))
    engine = llm.llm_engine
    samples = get_samples(args, tokenizer_token_ids(engine.tokenizer), tokenizer=engine.tokenizer)
    check_fits(samples, engine.max_model_len)
    prompts = [{"prompt_token_ids": s.prompt_token_ids} for s in samples]
    params = [bench_sampling_params(s.output_len) for s in samples]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=not args.disable_tqdm)
    elapsed = time.perf_counter() - start
    num_prompt_tokens = sum(s.prompt_len for s in samples)
    num_output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    result = throughput_result(elapsed, len(samples), num_prompt_tokens, num_output_tokens)
    print(
        f"Throughput: {result['requests_per_second']:.2f} requests/s, "
        f"{result['tokens_per_second']:.2f} total tokens/s, "
        f"{result['output_tokens_per_second']:.2f} output tokens/s"
    )
    stats = engine.stats()
    if stats.prefill_tokens_per_s and stats.decode_tokens_per_s:
        result["prefill_tokens_per_second"] = stats.prefill_tokens_per_s
        result["decode_tokens_per_second"] = stats.decode_tokens_per_s
        print(
            f"Prefill: {result['prefill_tokens_per_second']:.1f} prompt tokens/s over steps with prompt tokens; "
            f"decode: {result['decode_tokens_per_second']:.1f} tokens/s over decode-only steps"
        )
    if stats.steps.comm_s:
        result["comm_share_of_step_time"] = stats.steps.comm_s / stats.steps.steps_s
        print(f"Tensor parallel: {100 * result['comm_share_of_step_time']:.1f}% of step time in rank 0's collectives")
    llm.shutdown()
    print(f"Total num prompt tokens:  {num_prompt_tokens}")
    print(f"Total num output tokens:  {num_output_tokens}")
    save_result(result, args, "throughput")
    return 0
