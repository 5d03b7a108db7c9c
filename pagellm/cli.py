"""The ``pagellm`` command: serve, generate, chat, bench.

Each subcommand lives with the code it drives and registers itself through ``add_parser``;
this module only wires them together and holds the engine flags they share (vLLM's names).
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import Any, Optional, Sequence

# subcommand -> module with add_parser(subparsers) that sets func=callable(args) -> int
_SUBCOMMANDS = {
    "serve": "pagellm.entrypoints.openai.cli_serve",
    "generate": "pagellm.entrypoints.cli_generate",
    "chat": "pagellm.entrypoints.cli_chat",
    "bench": "pagellm.bench.cli",
}


def add_engine_args(parser: argparse.ArgumentParser, positional_model: bool = False) -> None:
    """Engine flags, named as vLLM's so users' habits carry over."""
    if positional_model:
        parser.add_argument("model_tag", nargs="?", default=None, help="HF directory or GGUF file (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--model", default=None, help="HF directory or GGUF file (default: packaged SmolLM2-135M-Instruct)")
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument(
        "--trust-remote-code", action="store_true",
        help="taken for vLLM's commands; changes nothing: pagellm builds every architecture itself and runs no code from a checkpoint",
    )
    parser.add_argument(
        "--language-model-only", action="store_true",
        help="taken for vLLM's commands; changes nothing: of a multimodal checkpoint pagellm loads only the language model",
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--kv-cache-memory", default=None, help="KV cache budget, e.g. 2GiB (default 2GiB)")
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="exact number of KV blocks (overrides --kv-cache-memory)")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument(
        "--num-state-slots", type=int, default=None,
        help="hybrid models: recurrent state slots (running requests' and prefix-cache checkpoints), from the KV budget (default: planned)",
    )
    parser.add_argument(
        "--state-checkpoint-interval", "--mamba-block-size", type=int, default=256, dest="state_checkpoint_interval",
        help="hybrid models: tokens between the recurrent state checkpoints prefix caching saves (a multiple of --block-size); "
        "--mamba-block-size is vLLM's name for it",
    )
    parser.add_argument(
        "--mamba-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
        help="hybrid models: the type of every recurrent state tensor (convolution tails, and the recurrent matrices unless "
        "--mamba-ssm-cache-dtype says otherwise); auto: tails in the activations' type, matrices in float32",
    )
    parser.add_argument(
        "--mamba-ssm-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
        help="hybrid models: the recurrent matrices' type (Gated DeltaNet, Mamba-2); auto: --mamba-cache-dtype's, float32 "
        "where that is auto; bfloat16 halves their memory",
    )
    parser.add_argument(
        "--packed-weight-cache",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep the CPU kernels' packed weights on disk (PAGELLM_PACKED_WEIGHT_CACHE, default "
        "~/.cache/pagellm/packed) so that later starts map them instead of packing (default on)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--dtype",
        default="auto",
        help="auto (the checkpoint's dtype; on a CPU only the linear layers' products take it, bfloat16 where the "
        "CPU has AVX512_BF16), float32 (exact), bfloat16 or float16",
    )
    parser.add_argument(
        "--quantization",
        "-q",
        choices=["gguf"],
        default=None,
        help="gguf: a GGUF model's 4/8-bit blocks dotted with int8-quantized inputs; "
        "the default for a GGUF model unless --dtype is given",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="KV cache element type: auto (the model's dtype; on a CPU bfloat16 under low-precision linear layers, "
        "else float32), float32, float16, bfloat16, or 8 bits: fp8 (= fp8_e4m3), fp8_e5m2 (per-layer scales), "
        "int8 (a scale per token and head)",
    )
    parser.add_argument(
        "--calculate-kv-scales",
        action="store_true",
        help="fp8 KV cache: measure each layer's key/value scales from the first step (else the checkpoint's, or 1.0)",
    )
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--attention-backend", default=None, help="cpu_paged, triton_paged, torch_sdpa or torch_ref (default: fastest)")
    parser.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument(
        "--gpu-memory-utilization", type=float, default=0.9, help="GPU: share of device memory to use; sizes the KV cache"
    )
    parser.add_argument("--enforce-eager", action="store_true", help="GPU: no CUDA graphs, every step runs eagerly")
    parser.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="ranks that split every layer (by KV-head groups); default 1"
    )
    parser.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="serve: engine replicas behind one server, requests routed by cached prefix (default 1)",
    )
    parser.add_argument(
        "--distributed-executor-backend",
        choices=["mp", "ray"],
        default=None,
        help="how tensor-parallel ranks run: mp (local processes, default) or ray (Ray actors)",
    )
    parser.add_argument(
        "--speculative-config",
        default=None,
        help='speculative decoding, vLLM\'s JSON: \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4}\' or \'{"model": DRAFT, "num_speculative_tokens": 4}\'',
    )
    parser.add_argument(
        "--kv-offloading-backend",
        choices=["native"],
        default=None,
        help="a second tier under the prefix cache for evicted blocks: host memory, or files with --kv-offloading-dir",
    )
    parser.add_argument("--kv-offloading-size", type=float, default=None, help="the tier's size in GiB")
    parser.add_argument(
        "--kv-offloading-dir",
        default=None,
        help="keep the tier in this directory (the server's own, mode 0700): it survives restarts",
    )
    parser.add_argument(
        "--reasoning-parser",
        default=None,
        help="how to find the model's thinking in its output (vLLM's names: qwen3, deepseek_r1, gpt_oss, granite, gemma4, string); "
        "it goes to reasoning/reasoning_content, grammars apply after it, thinking_token_budget closes it",
    )
    parser.add_argument(
        "--reasoning-config",
        default=None,
        help='the thinking\'s markers, vLLM\'s JSON: \'{"reasoning_start_str": "<think>", "reasoning_end_str": "</think>"}\' '
        "(with --reasoning-parser string; with another parser, reasoning_end_str is what a spent thinking budget writes)",
    )
    parser.add_argument(
        "--runner",
        choices=["generate", "pooling"],
        default=None,
        help="generate (default): sample tokens; pooling: embed prompts (/v1/embeddings, LLM.embed)",
    )
    parser.add_argument("--task", choices=["generate", "embed"], default=None, help="older vLLM's name: --task embed = --runner pooling")
    parser.add_argument(
        "--pooler-config",
        default=None,
        help='pooling runner, vLLM\'s JSON: \'{"pooling_type": "LAST"|"MEAN"|"CLS", "normalize": true}\' (default LAST, normalized)',
    )
    parser.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (docs/lora.md)")
    parser.add_argument("--max-loras", type=int, default=1, help="adapters in one batch at once (their slots; default 1)")
    parser.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank accepted (default 16)")
    parser.add_argument("--max-cpu-loras", type=int, default=None, help="adapters kept loaded in host memory (default: --max-loras)")
    parser.add_argument(
        "--lora-dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="the adapter slots' type (auto: bfloat16 under low-precision linear layers, float32 on the exact path)",
    )


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig keyword arguments from parsed engine flags; unset ones keep the defaults."""
    model = getattr(args, "model_tag", None) or args.model
    kwargs: dict[str, Any] = dict(
        model=model,
        tokenizer=args.tokenizer,
        served_model_name=args.served_model_name,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        kv_cache_memory_bytes=args.kv_cache_memory,
        num_kv_blocks=args.num_kv_blocks,
        enable_prefix_caching=args.enable_prefix_caching,
        num_state_slots=args.num_state_slots,
        state_checkpoint_interval=args.state_checkpoint_interval,
        mamba_cache_dtype=getattr(args, "mamba_cache_dtype", "auto"),
        trust_remote_code=getattr(args, "trust_remote_code", False),
        language_model_only=getattr(args, "language_model_only", False),
        mamba_ssm_cache_dtype=getattr(args, "mamba_ssm_cache_dtype", "auto"),
        packed_weight_cache=args.packed_weight_cache,
        seed=args.seed,
        dtype=args.dtype,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        calculate_kv_scales=args.calculate_kv_scales,
        device=args.device,
        attention_backend=args.attention_backend,
        num_threads=args.num_threads,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        tensor_parallel_size=args.tensor_parallel_size,
        distributed_executor_backend=args.distributed_executor_backend,
        speculative_config=args.speculative_config,
        reasoning_parser=getattr(args, "reasoning_parser", None),
        kv_offloading_backend=getattr(args, "kv_offloading_backend", None),
        kv_offloading_size=getattr(args, "kv_offloading_size", None),
        kv_offloading_dir=getattr(args, "kv_offloading_dir", None),
        reasoning_config=getattr(args, "reasoning_config", None),
        runner=getattr(args, "runner", None),
        task=getattr(args, "task", None),
        pooler_config=getattr(args, "pooler_config", None),
        enable_lora=getattr(args, "enable_lora", False),
        max_loras=getattr(args, "max_loras", 1),
        max_lora_rank=getattr(args, "max_lora_rank", 16),
        max_cpu_loras=getattr(args, "max_cpu_loras", None),
        lora_dtype=getattr(args, "lora_dtype", "auto"),
    )
    if args.max_num_seqs is not None:
        kwargs["max_num_seqs"] = args.max_num_seqs
    if args.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    return kwargs


def build_parser(argv: Optional[Sequence[str]] = None) -> argparse.ArgumentParser:
    """The command line's parser; given ``argv`` that names a subcommand, with that one alone (each
    imports its own stack: the server's, the benchmarks' HTTP client), which shortens a start."""
    parser = argparse.ArgumentParser(prog="pagellm", description="LLM inference and serving with a paged KV cache.")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    sub = parser.add_subparsers(dest="command", required=True)
    named = next((arg for arg in argv or () if arg in _SUBCOMMANDS), None)
    for module_name in [_SUBCOMMANDS[named]] if named else _SUBCOMMANDS.values():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name != module_name:
                raise
            continue  # not built yet in this checkout
        module.add_parser(sub)
    return parser


def dashed_flags(argv: Sequence[str]) -> list[str]:
    """``--max_model_len 512`` as ``--max-model-len 512``: vLLM's parser takes either spelling of a
    flag (its recipes and model cards use both), so commands copied from them run here too. Values
    and everything after a bare ``--`` are left as written."""
    out: list[str] = []
    for i, arg in enumerate(argv):
        if arg == "--":
            return out + list(argv[i:])
        if arg.startswith("--"):
            name, eq, value = arg[2:].partition("=")
            arg = "--" + name.replace("_", "-") + eq + value
        out.append(arg)
    return out


def main(argv: Optional[list[str]] = None) -> int:
    argv = dashed_flags(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if logging.getLogger().level > logging.DEBUG:
        logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request: thousands from `bench serve`
    try:
        return int(args.func(args) or 0)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
