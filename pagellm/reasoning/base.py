"""What every reasoning parser gives back, and the calls the serving layer and the engine make on one.

A reasoning parser splits a model's reply into its reasoning (the "thinking" before the answer) and
its content (the answer), whole (``extract_reasoning``) or streamed piece by piece
(``extract_reasoning_streaming``, then ``finish``): the streamed pieces always join into what the
whole reply gives. ``boundary_strings`` tells the engine, with no request at hand, which strings open
and close the reasoning section and what to write when a thinking budget runs out.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Optional, Sequence


@dataclass
class ReasoningDelta:
    """What one streamed piece adds: reasoning text and/or content text (either may be empty)."""

    reasoning: str = ""
    content: str = ""

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content)


@dataclass(frozen=True)
class ReasoningBoundaryStrings:
    """``start`` opens reasoning (None where nothing does), ``end`` is the string whose appearance ends
    it, ``forced_end`` is what the engine writes into the output when the thinking budget runs out."""

    start: Optional[str]
    end: str
    forced_end: str


def config_strings(reasoning_config: Optional[dict[str, Any]]) -> tuple[Optional[str], Optional[str]]:
    """(reasoning_start_str, reasoning_end_str) of vLLM's ``--reasoning-config``, None where unset."""
    if reasoning_config is None:
        return None, None
    if not isinstance(reasoning_config, dict):
        raise ValueError(f"reasoning_config must be a dict, got {type(reasoning_config).__name__}")
    unknown = set(reasoning_config) - {"reasoning_start_str", "reasoning_end_str", "reasoning_parser"}
    if unknown:
        raise ValueError(
            f"unknown reasoning_config keys {sorted(unknown)}; known: reasoning_start_str, reasoning_end_str, reasoning_parser"
        )
    out = []
    for key in ("reasoning_start_str", "reasoning_end_str"):
        value = reasoning_config.get(key)
        if value is not None and not isinstance(value, str):
            raise ValueError(f"reasoning_config[{key!r}] must be a string, got {type(value).__name__}")
        out.append(value or None)
    return out[0], out[1]


def decode(tokenizer: Any, token_ids: Sequence[int]) -> str:
    """The text of ``token_ids`` with special tokens kept (reasoning markers often are special)."""
    try:
        return tokenizer.decode(list(token_ids), skip_special_tokens=False)
    except TypeError:  # a duck-typed tokenizer without the keyword
        return tokenizer.decode(list(token_ids))


def token_pieces(tokenizer: Any, token_ids: Sequence[int]) -> list[str]:
    """Each token's share of the decoded text: their concatenation is the text. A token that ends in
    the middle of a multi-byte character gets "" and the token completing it gets the character."""
    ids = list(token_ids)
    pieces: list[str] = []
    start = 0  # first token whose text is not yet out
    for i in range(len(ids)):
        # A few tokens of context: byte-level and sentencepiece decoders depend on their neighbours.
        ctx = max(0, start - 4)
        before = decode(tokenizer, ids[ctx:start]) if start > ctx else ""
        after = decode(tokenizer, ids[ctx : i + 1])
        if after.endswith("\ufffd") and i < len(ids) - 1:
            pieces.append("")
            continue
        pieces.append(after[len(before) :] if after.startswith(before) else after)
        start = i + 1
    return pieces


class ReasoningParser(ABC):
    """One reply's parser (streaming keeps state). ``tokenizer`` is HF-style (``encode``, ``decode``,
    ``get_vocab``) or None where the parser needs none; ``prompt_token_ids`` tell whether the prompt
    already opened (or closed) the reasoning section; ``chat_template_kwargs`` such as
    ``{"enable_thinking": False}`` turn thinking off; ``reasoning_config`` is vLLM's
    ``--reasoning-config`` dict."""

    name: str = ""
    # The reply must be decoded with special tokens kept (the markers are special tokens).
    keep_special_tokens: bool = False

    def __init__(
        self,
        tokenizer: Any = None,
        prompt_token_ids: Sequence[int] = (),
        chat_template_kwargs: Optional[dict[str, Any]] = None,
        reasoning_config: Optional[dict[str, Any]] = None,
    ) -> None:
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise ValueError(f"chat_template_kwargs must be a dict, got {type(chat_template_kwargs).__name__}")
        self.tokenizer = tokenizer
        self.prompt_token_ids = list(prompt_token_ids)
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.reasoning_config = reasoning_config
        config_strings(reasoning_config)  # validates

    @classmethod
    @abstractmethod
    def boundary_strings(cls, reasoning_config: Optional[dict[str, Any]] = None) -> ReasoningBoundaryStrings:
        """The strings that open and close reasoning, and the one forced when a budget runs out."""

    @abstractmethod
    def extract_reasoning(self, text: str, token_ids: Sequence[int] = ()) -> tuple[Optional[str], Optional[str]]:
        """(reasoning, content) of a whole reply, each None where the reply has none (vLLM's semantics)."""

    @abstractmethod
    def extract_reasoning_streaming(self, delta_text: str, delta_token_ids: Sequence[int] = ()) -> ReasoningDelta:
        """Feeds the next piece of the reply; returns what may be sent now (a tail that may begin a
        marker is held back until it is known)."""

    @abstractmethod
    def finish(self) -> ReasoningDelta:
        """The reply has ended: whatever was held back."""

    @abstractmethod
    def num_reasoning_tokens(self, output_token_ids: Sequence[int]) -> int:
        """How many of the reply's tokens are reasoning (usage's ``reasoning_tokens``)."""
