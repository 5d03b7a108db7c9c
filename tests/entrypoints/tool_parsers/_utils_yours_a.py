"""What the qwen3_coder, llama3_json and mistral parser tests share: a case as data, the whole-reply check, and
the streamed check (the reply fed in pieces of every size and at token-like boundaries, each run compared with
the whole reply)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from pagellm.entrypoints.openai.tool_parsers import ParsedMessage, ToolParser

# Marker tokens first (a model emits each as one token), then words, whitespace runs and single symbols:
# close enough to a BPE split to stand in for the model tokenizers vLLM's tests load.
_TOKEN = re.compile(
    r"\[TOOL_CALLS\]|\[ARGS\]|\[CALL_ID\]|<\|python_tag\|>|</?tool_call>|<function=|</function>|<parameter=|</parameter>"
    r"|\w+|\s+|[^\w\s]"
)


@dataclass
class Case:
    """One reply and what it parses to: ``calls`` as (name, arguments as a dict); ``content`` None when the reply
    is only calls; ``tools`` the request's tools (OpenAI dicts) for parsers that type arguments by schema."""

    id: str
    text: str
    calls: list[tuple[str, dict[str, Any]]]
    content: Optional[str]
    tools: list[dict[str, Any]] = field(default_factory=list)


def token_pieces(text: str) -> list[str]:
    pieces = _TOKEN.findall(text)
    assert "".join(pieces) == text
    return pieces


def check_whole(parsed: ParsedMessage, case: Case) -> None:
    assert parsed.content == case.content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == case.calls
    assert len({c.id for c in parsed.tool_calls}) == len(parsed.tool_calls)


def stream(make: Callable[[], ToolParser], pieces: list[str]) -> tuple[str, list[tuple[int, str, str, str]]]:
    """Feeds ``pieces`` to a fresh parser; the content sent and the calls sent as (index, id, name, arguments)."""
    parser = make()
    content, calls = "", []
    for i, piece in enumerate(pieces):
        delta = parser.extract_streaming(piece, finished=i == len(pieces) - 1)
        content += delta.content
        calls += [(idx, c.id, c.name, c.arguments) for idx, c in delta.tool_calls]
    return content, calls


def check_streamed(make: Callable[[], ToolParser], case: Case, id_check: Optional[Callable[[str], bool]] = None) -> int:
    """Every piece size 1..len(text), then the token-like split: content as the whole reply's, the same calls, in
    order, each sent once with arguments that are a JSON object by themselves. Returns the number of runs."""
    text = case.text
    splits = [(f"pieces of {n}", [text[i : i + n] for i in range(0, len(text), n)]) for n in range(1, len(text) + 1)]
    splits.append(("token-like pieces", token_pieces(text)))
    for where, pieces in splits:
        content, calls = stream(make, pieces)
        assert content == (case.content or ""), where
        assert [idx for idx, *_ in calls] == list(range(len(case.calls))), where
        for (_, call_id, name, args), (want_name, want_args) in zip(calls, case.calls):
            assert name == want_name, where
            assert json.loads(args) == want_args, where
            assert isinstance(json.loads(args), dict)
            assert id_check is None or id_check(call_id), call_id
    return len(splits)
