"""``openai_gptoss`` (also ``gpt_oss``): gpt-oss's harmony format, read with ``openai_harmony``.

A gpt-oss reply is a run of harmony messages (``<|channel|>analysis<|message|>...<|end|>``,
``<|start|>assistant<|channel|>final<|message|>...<|return|>``): reasoning is the ``analysis``
channel's text, content the ``final`` channel's. The parser works on token ids, since the text may
have had the special tokens stripped; tool calls (``commentary`` to ``functions.NAME``) are the
``openai`` tool parser's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from pagellm.reasoning.base import ReasoningBoundaryStrings, ReasoningDelta, ReasoningParser, config_strings
from pagellm.reasoning.harmony_vocab import harmony_encoding

logger = logging.getLogger(__name__)

START, MESSAGE, CHANNEL = "<|start|>", "<|message|>", "<|channel|>"
ANALYSIS_OPEN = "<|channel|>analysis<|message|>"
FINAL_OPEN = "<|channel|>final<|message|>"
FORCED_FINAL = "<|end|><|start|>assistant<|channel|>final<|message|>"
# Tokens the model may write between "<|channel|>final" and "<|message|>" (a constrain header).
MAX_HEADER_TOKENS = 20


@dataclass
class HarmonyReader:
    """Token ids through a harmony ``StreamableParser`` (role assistant, as after ``<|start|>assistant``).
    A sequence harmony rejects ends the parse: what follows is kept as content, so nothing is lost."""

    encoding: Any
    parser: Any = None
    broken: Optional[list[int]] = None  # the tokens from the first one harmony rejected
    reasoning_tokens: int = 0

    def __post_init__(self) -> None:
        from openai_harmony import Role, StreamableParser

        self.parser = StreamableParser(self.encoding, role=Role.ASSISTANT)

    def feed(self, token_ids: Sequence[int]) -> None:
        from openai_harmony import HarmonyError, StreamState

        for token in token_ids:
            if self.broken is not None:
                self.broken.append(token)
                continue
            before = self.parser.state
            try:
                self.parser.process(token)
            except HarmonyError as e:
                logger.warning("harmony rejected token %d (%s); the rest of the reply is content", token, e)
                self.broken = [token]
                continue
            if before == StreamState.CONTENT and self.parser.state == StreamState.CONTENT and self.parser.current_channel == "analysis":
                self.reasoning_tokens += 1

    def end(self) -> None:
        from openai_harmony import HarmonyError

        if self.broken is None:
            try:
                self.parser.process_eos()
            except HarmonyError:  # cut off inside a header: nothing of it is text
                pass

    def channel_texts(self, final: bool) -> tuple[Optional[str], Optional[str]]:
        """(analysis text, final text) so far, each None where the reply has none; several messages
        of a channel are joined by newlines."""
        from openai_harmony import StreamState

        parts: dict[str, list[str]] = {"analysis": [], "final": []}
        for msg in self.parser.messages:
            if msg.channel in parts and not msg.recipient:
                parts[msg.channel].append("".join(getattr(c, "text", "") for c in msg.content))
        if self.parser.state == StreamState.CONTENT and self.parser.current_channel in parts and not self.parser.current_recipient:
            parts[self.parser.current_channel].append(self.parser.current_content)
        reasoning = "\n".join(parts["analysis"]) if parts["analysis"] else None
        content = "\n".join(parts["final"]) if parts["final"] else None
        if self.broken:
            tail = self.encoding.decode(self.broken)
            if not final:
                tail = tail.rstrip("\ufffd")  # a character still incomplete
            content = (content or "") + tail
        return reasoning, content


def is_reasoning_end(encoding: Any, token_ids: Sequence[int]) -> bool:
    """Whether the reply's last message has opened the final channel (``<|channel|>final`` and, within
    a few header tokens, ``<|message|>``); a later ``<|start|>`` begins a new message."""
    ids = list(token_ids)
    start_id = encoding.encode(START, allowed_special="all")
    prefix = encoding.encode("<|channel|>final", allowed_special="all")
    suffix = encoding.encode(MESSAGE, allowed_special="all")
    last_start = max((i for i in range(len(ids)) if ids[i : i + len(start_id)] == start_id), default=-1)
    segment = ids[last_start + 1 :]
    for i in range(len(segment) - len(prefix) + 1):
        if segment[i : i + len(prefix)] == prefix:
            after = segment[i + len(prefix) : i + len(prefix) + MAX_HEADER_TOKENS + len(suffix)]
            if any(after[j : j + len(suffix)] == suffix for j in range(len(after))):
                return True
    return False


def header_prefix(encoding: Any, prompt: Sequence[int]) -> list[int]:
    """A header the prompt already began after its last ``<|start|>assistant`` (a prefilled
    channel), to be read before the reply; usually nothing."""
    prompt = list(prompt)
    start = encoding.encode(START, allowed_special="all")
    role = encoding.encode("assistant", allowed_special="all")
    message = encoding.encode(MESSAGE, allowed_special="all")
    for i in range(len(prompt) - 1, -1, -1):
        if prompt[i : i + len(start)] == start:
            head = prompt[i + len(start) :]
            if head[: len(role)] != role:
                return []
            head = head[len(role) :]
            for j in range(len(head)):
                if head[j : j + len(message)] == message:
                    return head[: j + len(message)]
            return head
    return []


class GptOssReasoningParser(ReasoningParser):
    name = "openai_gptoss"
    keep_special_tokens = True

    def __init__(
        self,
        tokenizer: Any = None,
        prompt_token_ids: Sequence[int] = (),
        chat_template_kwargs: Optional[dict[str, Any]] = None,
        reasoning_config: Optional[dict[str, Any]] = None,
    ) -> None:
        super().__init__(tokenizer, prompt_token_ids, chat_template_kwargs, reasoning_config)
        self.encoding = harmony_encoding(tokenizer)
        self._prime = self._header_prefix(self.prompt_token_ids)
        self._stream = self._reader()
        self._sent = ("", "")

    def _header_prefix(self, prompt: list[int]) -> list[int]:
        return header_prefix(self.encoding, prompt)

    def _reader(self) -> HarmonyReader:
        reader = HarmonyReader(self.encoding)
        reader.feed(self._prime)
        reader.reasoning_tokens = 0
        return reader

    def _ids(self, text: str, token_ids: Sequence[int]) -> list[int]:
        # Without ids, the text must still hold the special tokens for harmony to read it.
        return list(token_ids) if token_ids or not text else self.encoding.encode(text, allowed_special="all")

    @classmethod
    def boundary_strings(cls, reasoning_config: Optional[dict[str, Any]] = None) -> ReasoningBoundaryStrings:
        start, end = config_strings(reasoning_config)
        return ReasoningBoundaryStrings(start or ANALYSIS_OPEN, FINAL_OPEN, end or FORCED_FINAL)

    def is_reasoning_end(self, token_ids: Sequence[int]) -> bool:
        return is_reasoning_end(self.encoding, token_ids)

    def extract_reasoning(self, text: str, token_ids: Sequence[int] = ()) -> tuple[Optional[str], Optional[str]]:
        reader = self._reader()
        reader.feed(self._ids(text, token_ids))
        reader.end()
        reasoning, content = reader.channel_texts(final=True)
        return reasoning or None, content or None

    def _delta(self, final: bool) -> ReasoningDelta:
        reasoning, content = (t or "" for t in self._stream.channel_texts(final))
        sent_r, sent_c = self._sent
        out = ReasoningDelta(
            reasoning[len(sent_r) :] if reasoning.startswith(sent_r) else "",
            content[len(sent_c) :] if content.startswith(sent_c) else "",
        )
        self._sent = (sent_r + out.reasoning, sent_c + out.content)
        return out

    def extract_reasoning_streaming(self, delta_text: str, delta_token_ids: Sequence[int] = ()) -> ReasoningDelta:
        self._stream.feed(self._ids(delta_text, delta_token_ids))
        return self._delta(final=False)

    def finish(self) -> ReasoningDelta:
        self._stream.end()
        return self._delta(final=True)

    def num_reasoning_tokens(self, output_token_ids: Sequence[int]) -> int:
        reader = self._reader()
        reader.feed(output_token_ids)
        return reader.reasoning_tokens
