"""``pagellm chat``: an interactive chat that streams the reply and keeps the conversation.

Each turn renders the whole history through the model's chat template; when it no longer fits
the context, the oldest exchanges are dropped (the system message stays). Ctrl-C stops the
current reply (what was said so far is kept); Ctrl-D or /exit leaves; /reset forgets the history.
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable, Optional, TextIO

from pagellm.engine.async_llm import AsyncLLM
from pagellm.entrypoints.cli_generate import add_sampling_args, sampling_params_from_args, start_engine, stream_request
from pagellm.sampling_params import SamplingParams

HELP = "commands: /reset (forget the conversation), /system TEXT (set the system message), /help, /exit"
# Fewer tokens than this left to answer in: drop old exchanges rather than give a clipped reply.
MIN_ROOM_TO_REPLY = 64


def add_parser(subparsers) -> argparse.ArgumentParser:
    from pagellm.cli import add_engine_args

    parser = subparsers.add_parser(
        "chat",
        help="interactive chat with the model, streaming its replies",
        description="Chat with the model in the terminal. " + HELP,
    )
    parser.add_argument("--system", default=None, help="system message for the conversation")
    add_sampling_args(parser, max_tokens=512, temperature=0.7)
    add_engine_args(parser)
    parser.set_defaults(func=run)
    return parser


class ChatSession:
    """The conversation and the engine behind it; the REPL is a thin loop over ``reply``."""

    def __init__(self, llm: AsyncLLM, make_params: Callable[[int], SamplingParams], max_tokens: int, system: Optional[str] = None) -> None:
        self.llm = llm
        self.make_params = make_params  # max_tokens -> this turn's SamplingParams
        self.max_tokens = max_tokens
        self.system = system
        self.history: list[dict[str, str]] = []
        self._num_turns = 0

    def reset(self) -> None:
        self.history.clear()

    def _prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        from pagellm.tokenizer import apply_chat_template

        system = [{"role": "system", "content": self.system}] if self.system else []
        return apply_chat_template(self.llm.tokenizer, system + messages)

    def _fit(self, messages: list[dict[str, str]]) -> tuple[list[int], list[dict[str, str]], int]:
        """Prompt ids of the longest recent history that leaves room to answer, and that room."""
        max_len = self.llm.max_model_len
        while True:
            ids = self._prompt_ids(messages)
            room = max_len - len(ids)
            if room >= min(self.max_tokens, MIN_ROOM_TO_REPLY) or len(messages) == 1:
                break
            messages = messages[2:]  # the oldest user/assistant exchange
        if room < 1:
            raise ValueError(f"that message is too long: {len(ids)} tokens, and the context holds {max_len}")
        return ids, messages, min(self.max_tokens, room)

    def reply(self, user_text: str, on_text: Callable[[str], None]) -> str:
        """Streams the answer through ``on_text`` and adds both messages to the history.

        On KeyboardInterrupt the partial answer is kept in the history and the interrupt re-raised.
        """
        ids, kept, max_tokens = self._fit(self.history + [{"role": "user", "content": user_text}])
        self.history = kept
        self._num_turns += 1
        request_id = f"chat-{self._num_turns}"
        parts: list[str] = []

        def collect(index: int, text: str) -> None:
            parts.append(text)
            on_text(text)

        try:
            stream_request(self.llm, request_id, {"prompt_token_ids": ids}, self.make_params(max_tokens), collect)
        finally:
            self.history.append({"role": "assistant", "content": "".join(parts)})
        return "".join(parts)


def repl(session: ChatSession, read: Callable[[str], str], out: TextIO) -> int:
    """The read-eval-print loop; ``read`` is ``input`` (raises EOFError on Ctrl-D)."""

    def write(text: str) -> None:
        out.write(text)
        out.flush()

    write(f"Chatting with {session.llm.model_name}. {HELP}\n")
    while True:
        try:
            line = read(">>> ").strip()
        except EOFError:
            write("\n")
            return 0
        except KeyboardInterrupt:
            write("\n")
            continue
        if not line:
            continue
        if line in ("/exit", "/quit"):
            return 0
        if line == "/help":
            write(HELP + "\n")
            continue
        if line == "/reset":
            session.reset()
            write("(conversation cleared)\n")
            continue
        if line.startswith("/system"):
            session.system = line[len("/system") :].strip() or None
            write(f"(system message {'set' if session.system else 'cleared'})\n")
            continue
        try:
            session.reply(line, write)
            write("\n")
        except KeyboardInterrupt:
            write(" [stopped]\n")
        except ValueError as e:
            write(f"error: {e}\n")


def run(args: argparse.Namespace, read: Callable[[str], str] = input, out: Optional[TextIO] = None) -> int:
    sampling_params_from_args(args)  # bad sampling flags fail before the model loads
    if read is input and sys.stdin.isatty():
        try:
            import readline  # noqa: F401 - gives input() line editing and history
        except ImportError:
            pass
    llm = start_engine(args)
    try:
        session = ChatSession(llm, lambda max_tokens: sampling_params_from_args(args, max_tokens=max_tokens), args.max_tokens, args.system)
        return repl(session, read, out or sys.stdout)
    finally:
        llm.shutdown()
