"""What the reasoning parser tests share: a case as data, a small BPE tokenizer with the parsers' special
tokens (trained here on the cases' own text, so nothing is downloaded), and the whole / streamed checks.

Streamed checks feed a reply token by token through the tokenizer and also in pieces of every size (splits
inside markers included); the pieces, then ``finish()``, must join into what the whole reply gives."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from pagellm.reasoning.base import token_pieces

SPECIAL = [
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<|channel>",
    "<channel|>",
    "<|tool_call>",
    "<|turn>",
    "<start:x>",
    "<end:x>",
]


@dataclass(frozen=True)
class Case:
    """A reply and its (reasoning, content) as the whole-reply call returns them; streamed checks compare
    with None read as ""."""

    id: str
    output: str
    reasoning: Optional[str]
    content: Optional[str]
    kwargs: dict[str, Any] = field(default_factory=dict)  # the parser's constructor arguments besides the tokenizer


def make_tokenizer(corpus: Sequence[str]) -> Any:
    """A byte-level BPE tokenizer (HF fast tokenizer API) trained on ``corpus``, markers as special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(list(corpus), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, additional_special_tokens=SPECIAL)


def token_texts(tokenizer: Any, text: str) -> list[str]:
    pieces = token_pieces(tokenizer, tokenizer.encode(text, add_special_tokens=False))
    assert "".join(pieces) == text, pieces
    return pieces


def run_stream(parser: Any, pieces: Sequence[str]) -> tuple[str, str]:
    reasoning = content = ""
    for piece in pieces:
        d = parser.extract_reasoning_streaming(piece)
        reasoning += d.reasoning
        content += d.content
    d = parser.finish()
    return reasoning + d.reasoning, content + d.content


def check_whole(cls: Any, tokenizer: Any, case: Case) -> None:
    assert cls(tokenizer, **case.kwargs).extract_reasoning(case.output) == (case.reasoning, case.content)


def check_streamed(cls: Any, tokenizer: Any, case: Case) -> None:
    want = (case.reasoning or "", case.content or "")
    assert run_stream(cls(tokenizer, **case.kwargs), token_texts(tokenizer, case.output)) == want, "token by token"
    text = case.output
    for size in range(1, max(len(text), 1) + 1):
        pieces = [text[i : i + size] for i in range(0, len(text), size)]
        assert run_stream(cls(tokenizer, **case.kwargs), pieces) == want, f"pieces of {size}"


def check_deltas(cls: Any, tokenizer: Any, before: Optional[str], delta: str, reasoning: Optional[str], content: Optional[str]) -> None:
    """One delta's own output after ``before`` was fed (vLLM's streaming sub-cases; None read as "")."""
    parser = cls(tokenizer)
    if before:
        parser.extract_reasoning_streaming(before)
    d = parser.extract_reasoning_streaming(delta)
    assert (d.reasoning, d.content) == (reasoning or "", content or "")
