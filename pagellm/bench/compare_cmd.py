"""``pagellm bench compare``: the paged design against the traditional one, side by side.

    pagellm bench compare --dataset-name variable --num-prompts 64 \\
        --max-model-len 2048 --num-kv-blocks 1024 --block-size 16 --plot docs/img

Same model, workload and KV budget for both. With no budget given, the cache holds
8 x max_model_len tokens, so a design that reserves max_model_len per request fits 8 at once.
``--block-size-sweep 8,16,...,512`` reruns the paged design at each block size with the same
budget in tokens. Prefix caching is off unless asked for: it is not part of what the contiguous
design can do, and shared blocks would blur the utilization figures.
"""
from __future__ import annotations

import argparse

from pagellm.bench.baseline import RESERVE_MODES
from pagellm.bench.common import add_result_args, positive_int_list, save_result
from pagellm.bench.datasets import add_dataset_args, check_fits, get_samples, tokenizer_token_ids

DEFAULT_MAX_MODEL_LEN = 2048
DEFAULT_MAX_NUM_BATCHED_TOKENS = 4096
DEFAULT_BUDGET_SEQS = 8  # default KV budget, in max_model_len sequences


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    from pagellm.cli import add_engine_args

    add_dataset_args(parser, default_name="variable", default_num_prompts=64)
    add_engine_args(parser)
    parser.set_defaults(
        max_model_len=DEFAULT_MAX_MODEL_LEN,
        # Large enough that a whole static batch of prompts is admitted in one step; both designs
        # get the same value.
        max_num_batched_tokens=DEFAULT_MAX_NUM_BATCHED_TOKENS,
        enable_prefix_caching=False,
    )
    parser.add_argument(
        "--contiguous-reserve",
        default="max_model_len",
        help=f"what each contiguous reservation covers, comma-separated to run several: {', '.join(RESERVE_MODES)} "
        "(max_tokens is prompt + max_tokens: an oracle that knows each output length)",
    )
    parser.add_argument("--block-size-sweep", default=None, help="paged block sizes to sweep, e.g. 8,16,32,64,128,512")
    parser.add_argument("--sweep-only", action="store_true", help="skip the contiguous runs (with --block-size-sweep)")
    parser.add_argument("--plot", default=None, metavar="DIR", help="write PNG charts into DIR")
    parser.add_argument("--block-map-png", default=None, metavar="PATH", help="draw the designs' KV block maps side by side into PATH")
    parser.add_argument("--no-timeline", action="store_true", help="leave the per-step samples out of the JSON")
    parser.add_argument("--disable-tqdm", action="store_true")
    add_result_args(parser)


def parse_reserve_modes(text: str) -> list[str]:
    modes = [m.strip().replace("-", "_") for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in RESERVE_MODES]
    if bad or not modes:
        raise ValueError(f"--contiguous-reserve must list modes from {RESERVE_MODES}, got {text!r}")
    return modes


def main(args: argparse.Namespace) -> int:
    from pagellm.bench.compare import compare_result_json, format_compare_table, format_sweep_table, run_compare
    from pagellm.cli import engine_kwargs
    from pagellm.config import EngineConfig
    from pagellm.engine.llm_engine import LLMEngine

    reserve_modes = parse_reserve_modes(args.contiguous_reserve)
    sweep = positive_int_list(args.block_size_sweep) if args.block_size_sweep else []
    if args.sweep_only and not sweep:
        raise ValueError("--sweep-only needs --block-size-sweep")
    kwargs = engine_kwargs(args)
    if kwargs["num_kv_blocks"] is None and kwargs["kv_cache_memory_bytes"] is None:
        max_len = args.max_model_len
        kwargs["num_kv_blocks"] = DEFAULT_BUDGET_SEQS * -(-max_len // args.block_size)
    for bs in sweep:
        # Checked up front: a bad size found after minutes of benchmarking wastes the run.
        EngineConfig(block_size=bs, device="cpu")
    engine = LLMEngine(EngineConfig(**kwargs))
    budget_tokens = engine.stats().scheduler.num_blocks * engine.config.block_size
    samples = get_samples(args, tokenizer_token_ids(engine.tokenizer), tokenizer=engine.tokenizer)
    check_fits(samples, engine.max_model_len)
    print(
        f"{len(samples)} requests, {sum(s.prompt_len for s in samples)} prompt + {sum(s.output_len for s in samples)} "
        f"output tokens; KV budget {budget_tokens} tokens ({budget_tokens / engine.max_model_len:.1f} x max_model_len "
        f"{engine.max_model_len})"
    )
    if args.block_map_png:
        from pagellm.bench.block_map import BlockMapRecorder

        recorder = BlockMapRecorder.install(engine)
    out = run_compare(
        engine,
        samples,
        budget_tokens,
        args.block_size,
        reserve_modes,
        sweep,
        use_tqdm=not args.disable_tqdm,
        include_contiguous=not args.sweep_only,
    )
    designs, points = out["designs"], out["sweep"]
    print(format_compare_table(designs))
    if points:
        print(format_sweep_table(points))
    config = {
        "dataset_name": args.dataset_name,
        "num_prompts": len(samples),
        "seed": args.seed,
        "max_model_len": engine.max_model_len,
        "block_size": args.block_size,
        "kv_budget_tokens": budget_tokens,
        "max_num_seqs": engine.config.max_num_seqs,
        "max_num_batched_tokens": engine.config.max_num_batched_tokens,
        "contiguous_reserve": [] if args.sweep_only else reserve_modes,
        "input_lens": [s.prompt_len for s in samples],
        "output_lens": [s.output_len for s in samples],
    }
    if args.plot:
        from pagellm.bench.plots import plot_compare

        for path in plot_compare(designs, points, args.plot):
            print(f"Wrote {path}")
    if args.block_map_png:
        print(f"Wrote {recorder.write_png(args.block_map_png, [d.label for d in designs])}")
    save_result(compare_result_json(designs, points, config, not args.no_timeline), args, f"compare-{args.dataset_name}")
    return 0
