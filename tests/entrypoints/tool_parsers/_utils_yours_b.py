"""Checks shared by the pythonic, granite and gemma4 tool-parser tests: a reply parsed whole, and the
same reply streamed in pieces (every size, and token-like pieces), must agree."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Sequence

from pagellm.entrypoints.openai.tool_parsers.base import ParsedMessage, ToolParser


@dataclass
class Streamed:
    content: str = ""
    calls: list[tuple[str, str]] = field(default_factory=list)  # (name, arguments)
    ids: list[str] = field(default_factory=list)


def stream(parser_cls: type[ToolParser], pieces: Sequence[str]) -> Streamed:
    """Feeds ``pieces`` to one parser (the last one finishes the reply) and joins what comes out.
    Checks on the way what every stream must keep: call indexes in order, each call once."""
    parser, out = parser_cls(), Streamed()
    for n, piece in enumerate(pieces):
        delta = parser.extract_streaming(piece, finished=n == len(pieces) - 1)
        out.content += delta.content
        for index, call in delta.tool_calls:
            assert index == len(out.calls), f"call index {index} after {len(out.calls)} calls"
            out.calls.append((call.name, call.arguments))
            out.ids.append(call.id)
    return out


def pieces_of(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


def token_pieces(text: str, specials: Sequence[str] = ()) -> list[str]:
    """Pieces as a tokenizer might cut them: each special marker whole, words, runs of spaces, and
    single punctuation characters."""
    alternatives = [re.escape(s) for s in sorted(specials, key=len, reverse=True)] + [r"\w+", r"\s+", r"[^\w\s]"]
    return re.findall("|".join(alternatives), text) or [""]


def whole_and_streamed(parser_cls: type[ToolParser], text: str, specials: Sequence[str] = ()) -> ParsedMessage:
    """``text`` parsed whole; and streamed in pieces of every size 1..len(text), in token-like
    pieces, and token-like pieces ended by an empty finishing piece: each stream's content must
    join into the whole reply's content, its calls must be the whole reply's calls with distinct
    ids, and every call's arguments a JSON object."""
    whole = parser_cls().extract(text)
    expected = [(c.name, c.arguments) for c in whole.tool_calls]
    for c in whole.tool_calls:
        assert isinstance(json.loads(c.arguments), dict), c.arguments
    tokens = token_pieces(text, specials)
    splits = [pieces_of(text, size) for size in range(1, len(text) + 1)] + [tokens, tokens + [""]]
    for pieces in splits:
        got = stream(parser_cls, pieces)
        where = f"pieces {pieces[:4]}... ({len(pieces)})"
        assert got.content == (whole.content or ""), f"{where}: content {got.content!r} != {whole.content!r}"
        assert got.calls == expected, f"{where}: calls {got.calls} != {expected}"
        assert len(set(got.ids)) == len(got.ids), where
    return whole


def names_args(message: ParsedMessage) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in message.tool_calls]
