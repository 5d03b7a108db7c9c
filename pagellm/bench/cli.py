"""``pagellm bench {throughput,latency,serve,compare}``: registers the benchmark subcommands.

Each subcommand's flags and ``main`` live in its own module; heavy imports (the engine, matplotlib)
happen inside ``main`` or behind ``--plot``, so building the parser stays cheap.
"""
from __future__ import annotations

import argparse
import importlib

_COMMANDS = {
    "throughput": ("pagellm.bench.throughput", "offline throughput: every request at once, in-process"),
    "latency": ("pagellm.bench.latency", "latency of one batch, repeated"),
    "serve": ("pagellm.bench.serve", "load-test an OpenAI-compatible server over HTTP (vLLM's metrics)"),
    "compare": ("pagellm.bench.compare_cmd", "paged + continuous batching vs contiguous + static batching"),
    "agent": ("pagellm.bench.agent", "multi-turn agent sessions whose prefixes outgrow the KV budget: prefix-hit share and TTFT"),
    "prefix-cache": ("pagellm.bench.prefix_cache", "shared-prefix burst with and without prefix caching"),
    "profile": ("pagellm.bench.profile_step", "where a decode step's time goes"),
    "mfu": ("pagellm.bench.flops", "matmul peak of this machine and model FLOP utilization of bench results"),
}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks", description="Benchmarks of pagellm and of any OpenAI server.")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    for name, (module_name, help_text) in _COMMANDS.items():
        module = importlib.import_module(module_name)
        parser = sub.add_parser(name, help=help_text, description=(module.__doc__ or "").split("\n\n")[0])
        module.add_cli_args(parser)
        parser.set_defaults(func=module.main)
