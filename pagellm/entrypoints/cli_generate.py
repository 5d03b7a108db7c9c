"""``pagellm generate "prompt"``: one completion, streamed to stdout as it is generated."""
from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any, Callable, Optional, TextIO

from pagellm.engine.async_llm import AsyncLLM
from pagellm.sampling_params import SamplingParams


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int, temperature: float) -> None:
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    parser.add_argument("--temperature", type=float, default=temperature)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--presence-penalty", type=float, default=0.0)
    parser.add_argument("--frequency-penalty", type=float, default=0.0)
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")
    # --seed is the engine's; this one seeds the sampler for this request only.
    parser.add_argument("--sampling-seed", type=int, default=None, help="seed for this request's sampling")


def sampling_params_from_args(args: argparse.Namespace, **overrides: Any) -> SamplingParams:
    kwargs: dict[str, Any] = dict(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        seed=args.sampling_seed,
    )
    kwargs.update(overrides)
    return SamplingParams(**kwargs)


def stream_request(
    llm: AsyncLLM, request_id: str, prompt: Any, params: SamplingParams, on_text: Callable[[int, str], None]
) -> dict[int, str]:
    """Runs one request to completion, passing each sample's new text to ``on_text`` as it comes.

    The engine steps on AsyncLLM's thread, as in the server (on a busy machine torch's thread pool
    runs far slower driven from the main thread), and the main thread stays free for Ctrl-C.
    Returns each sample's full text. On KeyboardInterrupt (or any error) the request is aborted,
    so the engine stays usable, and the exception propagates.
    """

    async def consume() -> dict[int, str]:
        texts: dict[int, str] = {}
        try:
            async for output in llm.generate(prompt, params, request_id):
                if output.error:
                    raise RuntimeError(f"generation failed: {output.error}")
                for completion in output.outputs:
                    if completion.text:
                        texts[completion.index] = texts.get(completion.index, "") + completion.text
                        on_text(completion.index, completion.text)
        except BaseException:
            llm.abort(request_id)
            raise
        return texts

    return asyncio.run(consume())


def print_sample_zero(out: TextIO) -> Callable[[int, str], None]:
    def write(index: int, text: str) -> None:
        if index == 0:
            out.write(text)
            out.flush()

    return write


def add_parser(subparsers) -> argparse.ArgumentParser:
    from pagellm.cli import add_engine_args

    parser = subparsers.add_parser(
        "generate",
        help="generate one completion for a prompt and print it",
        description="Generate text for one prompt ('-' reads it from stdin) and print it as it comes.",
    )
    parser.add_argument("prompt", help="the prompt, or '-' to read it from stdin")
    parser.add_argument("--chat", action="store_true", help="send the prompt as a user message through the chat template")
    parser.add_argument("--system", default=None, help="system message (with --chat)")
    parser.add_argument("--n", type=int, default=1, help="number of samples (each printed after the first)")
    add_sampling_args(parser, max_tokens=128, temperature=0.0)
    add_engine_args(parser)
    parser.set_defaults(func=run)
    return parser


def start_engine(args: argparse.Namespace) -> AsyncLLM:
    from pagellm.cli import engine_kwargs
    from pagellm.config import EngineConfig

    return AsyncLLM.from_config(EngineConfig(**engine_kwargs(args)))


def run(args: argparse.Namespace, stdout: Optional[TextIO] = None) -> int:
    stdout = stdout or sys.stdout
    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    params = sampling_params_from_args(args, n=args.n)  # bad flags fail before the model loads
    llm = start_engine(args)
    try:
        prompt: Any = text
        if args.chat:
            from pagellm.tokenizer import apply_chat_template

            messages = ([{"role": "system", "content": args.system}] if args.system else []) + [{"role": "user", "content": text}]
            prompt = {"prompt_token_ids": apply_chat_template(llm.tokenizer, messages)}
        texts = stream_request(llm, "generate-0", prompt, params, print_sample_zero(stdout))
    finally:
        llm.shutdown()
    stdout.write("\n")
    for index in range(1, args.n):
        stdout.write(f"--- sample {index} ---\n{texts.get(index, '')}\n")
    stdout.flush()
    return 0
