"""``pagellm bench prefix-cache``: the shared-prefix workload with and without prefix caching.

    pagellm bench prefix-cache --num-prompts 64 --num-prefixes 4 --prefix-len 512 \\
        --suffix-len 64 --output-len 64

Every request is submitted at once, as a burst of users behind a few system prompts. For each
setting it reports prompt tokens served from the cache and computed, the peak number of KV
blocks in use, end-to-end time and mean time to first token; the ideal hit count is
``(num_prompts - num_prefixes) * prefix_len`` rounded down to whole blocks.
"""
from __future__ import annotations

import argparse
import time
from typing import Any

from pagellm.bench.common import add_result_args, save_result
from pagellm.bench.compare import bench_sampling_params
from pagellm.bench.datasets import add_dataset_args, get_samples, tokenizer_token_ids


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    from pagellm.cli import add_engine_args

    add_dataset_args(parser, default_name="prefix", default_num_prompts=64)
    add_engine_args(parser)
    add_result_args(parser)


def run_once(llm, samples) -> dict[str, Any]:
    """Runs the burst through the engine step by step, watching the block pool."""
    from pagellm.engine.output_processor import RequestOutputKind

    engine = llm.llm_engine
    engine.reset_prefix_cache()
    before = engine.stats().scheduler
    start = time.monotonic()
    for i, s in enumerate(samples):
        engine.add_request(
            f"p{i}", {"prompt_token_ids": s.prompt_token_ids}, bench_sampling_params(s.output_len),
            RequestOutputKind.FINAL_ONLY, arrival_time=start,
        )
    peak_blocks = peak_checkpoints = 0
    ttfts, finished = [], 0
    while engine.has_unfinished_requests():
        for out in llm._step_thread.submit(engine.step).result():
            if out.finished:
                finished += 1
                ttfts.append(out.metrics.first_token_time - out.metrics.arrival_time)
        peak_blocks = max(peak_blocks, engine.stats().scheduler.num_used_blocks)
        state = engine.stats().scheduler.state_cache
        if state is not None:
            peak_checkpoints = max(peak_checkpoints, state.num_checkpoints)
    elapsed = time.monotonic() - start
    after = engine.stats().scheduler
    num_hits = after.prefix_cache_hits - before.prefix_cache_hits
    num_queries = after.prefix_cache_queries - before.prefix_cache_queries
    num_prompt_tokens = sum(s.prompt_len for s in samples)
    hybrid = {}
    if after.state_cache is not None:  # a hybrid model: the recurrent states prefix caching saved
        slot_bytes = engine.core.kv_cache_plan.state_slot_bytes
        hybrid = {
            "state_checkpoints_saved": after.state_cache.num_checkpoints_written - before.state_cache.num_checkpoints_written,
            "state_checkpoints_restored": after.state_cache.num_checkpoints_restored - before.state_cache.num_checkpoints_restored,
            "peak_state_checkpoint_bytes": peak_checkpoints * slot_bytes,
        }
    return {
        "num_requests": finished,
        "prompt_tokens": num_prompt_tokens,
        "prompt_tokens_from_cache": num_hits,
        "prompt_tokens_computed": num_prompt_tokens - num_hits,
        "prefix_cache_queries": num_queries,
        "peak_kv_blocks_in_use": peak_blocks,
        "elapsed_s": elapsed,
        "mean_ttft_s": sum(ttfts) / len(ttfts),
        "output_throughput": sum(s.output_len for s in samples) / elapsed,
        **hybrid,
    }


def main(args: argparse.Namespace) -> int:
    from pagellm import LLM
    from pagellm.cli import engine_kwargs

    kwargs = engine_kwargs(args)
    results: dict[str, Any] = {}
    for label, caching in (("with_cache", True), ("without_cache", False)):
        llm = LLM(**{**kwargs, "enable_prefix_caching": caching})
        samples = get_samples(args, tokenizer_token_ids(llm.llm_engine.tokenizer), tokenizer=llm.llm_engine.tokenizer)
        results[label] = run_once(llm, samples)
        block_size = llm.llm_engine.config.block_size
        del llm
    ideal = (args.num_prompts - args.num_prefixes) * (args.prefix_len // block_size) * block_size
    results["ideal_prompt_tokens_from_cache"] = ideal
    results["fraction_of_ideal"] = results["with_cache"]["prompt_tokens_from_cache"] / ideal if ideal else 0.0
    rows = [
        ("Prompt tokens from cache", "prompt_tokens_from_cache", "{:d}"),
        ("Prompt tokens computed", "prompt_tokens_computed", "{:d}"),
        ("Peak KV blocks in use", "peak_kv_blocks_in_use", "{:d}"),
        ("End-to-end time (s)", "elapsed_s", "{:.2f}"),
        ("Mean TTFT (s)", "mean_ttft_s", "{:.2f}"),
        ("Output throughput (tok/s)", "output_throughput", "{:.1f}"),
    ]
    print(f"{'':<28}{'with cache':>14}{'without cache':>16}")
    for title, key, fmt in rows:
        print(f"{title:<28}{fmt.format(results['with_cache'][key]):>14}{fmt.format(results['without_cache'][key]):>16}")
    print(f"Cache hits: {results['with_cache']['prompt_tokens_from_cache']} of ideal {ideal} "
          f"({100 * results['fraction_of_ideal']:.1f}%)")
    if "state_checkpoints_saved" in results["with_cache"]:
        r = results["with_cache"]
        print(f"Recurrent states: {r['state_checkpoints_saved']} saved, {r['state_checkpoints_restored']} resumed from, "
              f"peak {r['peak_state_checkpoint_bytes'] / 2**20:.1f} MiB held")
    save_result(results, args, "prefix-cache")
    return 0
