"""``pagellm generate "prompt"``: one completion, streamed to stdout as it is generated."""
from __future__ import annotations

import argparse
import sys
from typing import Any, Callable, Optional, TextIO

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


def stream_request(engine, request_id: str, on_text: Callable[[int, str], None]) -> dict[int, str]:
    """Steps the engine until ``request_id`` finishes, passing each sample's new text to ``on_text``.

    Returns each sample's full text. On KeyboardInterrupt (or any error) the request is aborted,
    so the engine stays usable, and the exception propagates.
    """
    texts: dict[int, str] = {}
    try:
        while engine.has_unfinished_requests():
            for _, output in engine.step():
                if output.request_id != request_id:
                    continue
                if output.error:
                    raise RuntimeError(f"generation failed: {output.error}")
                for completion in output.outputs:
                    if completion.text:
                        texts[completion.index] = texts.get(completion.index, "") + completion.text
                        on_text(completion.index, completion.text)
                if output.finished:
                    return texts
    except BaseException:
        engine.abort_request([request_id])
        raise
    return texts


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


def run(args: argparse.Namespace, stdout: Optional[TextIO] = None) -> int:
    from pagellm.cli import engine_kwargs
    from pagellm.config import EngineConfig
    from pagellm.engine.llm_engine import LLMEngine
    from pagellm.engine.output_processor import RequestOutputKind

    stdout = stdout or sys.stdout
    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    params = sampling_params_from_args(args, n=args.n)
    engine = LLMEngine(EngineConfig(**engine_kwargs(args)))
    prompt: Any = text
    if args.chat:
        from pagellm.tokenizer import apply_chat_template

        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [{"role": "user", "content": text}]
        prompt = {"prompt_token_ids": apply_chat_template(engine.tokenizer, messages)}
    engine.add_request("generate-0", prompt, params, RequestOutputKind.DELTA)
    texts = stream_request(engine, "generate-0", print_sample_zero(stdout))
    stdout.write("\n")
    for index in range(1, args.n):
        stdout.write(f"--- sample {index} ---\n{texts.get(index, '')}\n")
    stdout.flush()
    return 0
