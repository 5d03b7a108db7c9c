"""``openai``: gpt-oss's tool calls, harmony ``commentary`` messages to ``functions.NAME``, as vLLM's
parser of that name.

The reply is read from its token ids with ``openai_harmony`` (the text may have lost its special
tokens). Each call's arguments are the message's text, re-serialised when it is JSON; the content is
the ``final`` channel's text, else a ``commentary`` preamble meant for the user. Streaming sends the
final channel's text as it comes and each call once its message is complete.
"""

from __future__ import annotations

import json
from typing import Any, Optional, Sequence

from pagellm.entrypoints.openai.tool_parsers.base import ParsedMessage, ParsedToolCall, PartialParse, StreamDelta, ToolParser
from pagellm.reasoning.gpt_oss import HarmonyReader, header_prefix
from pagellm.reasoning.harmony_vocab import harmony_encoding

FUNCTIONS = "functions."


def call_of(message: Any) -> Optional[ParsedToolCall]:
    """The call a finished harmony message makes, None when it is not one to a function."""
    recipient = message.recipient or ""
    if not recipient.startswith(FUNCTIONS):
        return None
    text = "".join(getattr(c, "text", "") for c in message.content)
    args = text
    # No content type: gpt-oss writes JSON there too.
    if not message.content_type or "json" in message.content_type:
        try:
            args = json.dumps(json.loads(text), ensure_ascii=False)
        except ValueError:
            args = text  # kept as written, as vLLM does
    return ParsedToolCall(recipient[len(FUNCTIONS) :], args)


class OpenAIToolParser(ToolParser):
    name = "openai"

    def __init__(self, tools: Optional[list[dict[str, Any]]] = None, tokenizer: Any = None) -> None:
        super().__init__(tools)
        self.encoding = harmony_encoding(tokenizer)
        self._prime: list[int] = []
        self._reader = self._new_reader()
        self._sent_final = ""

    def prime(self, prompt_token_ids: Sequence[int]) -> None:
        # A prompt that opened the reply's channel (e.g. ends in <|channel|>analysis<|message|>)
        # is read first, as the reasoning parser reads it, or the reply would parse as a header.
        self._prime = header_prefix(self.encoding, prompt_token_ids)
        self._reader = self._new_reader()

    def _new_reader(self) -> HarmonyReader:
        reader = HarmonyReader(self.encoding)
        reader.feed(self._prime)
        return reader

    def _ids(self, text: str, token_ids: Sequence[int]) -> list[int]:
        return list(token_ids) if token_ids or not text else self.encoding.encode(text, allowed_special="all")

    def _read(self, text: str, token_ids: Sequence[int]) -> HarmonyReader:
        reader = self._new_reader()
        reader.feed(self._ids(text, token_ids))
        return reader

    @staticmethod
    def _calls(reader: HarmonyReader) -> list[ParsedToolCall]:
        return [call for msg in reader.parser.messages if (call := call_of(msg)) is not None]

    @staticmethod
    def _preamble(reader: HarmonyReader) -> Optional[str]:
        texts = [
            "".join(getattr(c, "text", "") for c in msg.content)
            for msg in reader.parser.messages
            if msg.channel == "commentary" and not msg.recipient
        ]
        return texts[-1] if texts else None

    def extract(self, text: str, token_ids: Sequence[int] = ()) -> ParsedMessage:
        reader = self._read(text, token_ids)
        reader.end()
        _, final = reader.channel_texts(final=True)
        return ParsedMessage(final or self._preamble(reader) or None, self._calls(reader))

    def partial(self, text: str, token_ids: Sequence[int] = ()) -> PartialParse:
        # The text is not content from its first character (harmony headers come first), so no
        # prefix of it is sent as content here; extract_streaming sends the final channel instead.
        return PartialParse(0, self._calls(self._read(text, token_ids)))

    def extract_streaming(self, delta_text: str, finished: bool, delta_token_ids: Sequence[int] = ()) -> StreamDelta:
        if self._done:
            return StreamDelta()
        self._reader.feed(self._ids(delta_text, delta_token_ids))
        if finished:
            self._done = True
            self._reader.end()
        out = StreamDelta()
        _, final = self._reader.channel_texts(final=finished)
        final = final or ""
        if final.startswith(self._sent_final) and len(final) > len(self._sent_final):
            out.content = final[len(self._sent_final) :]
            self._sent_final = final
        calls = self._calls(self._reader)
        for i, call in enumerate(calls[self._num_calls :], start=self._num_calls):
            out.tool_calls.append((i, call))
        self._num_calls = len(calls)
        if finished and not self._sent_final:
            out.content = self._preamble(self._reader) or ""
        return out
