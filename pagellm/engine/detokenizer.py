"""Incremental detokenization with stop strings, safe for streaming.

Decoding uses vLLM's prefix/read offset scheme on token ids: each new token is decoded together
with the few tokens before it (the "prefix" window, already emitted) and the text beyond the
prefix's own decoding is the new text. Only a window of a few tokens is decoded per step, so the
cost per token is O(1) however long the output grows.

The window is only advanced once its text ends in a complete character; while it ends in U+FFFD
(a multibyte character split across byte-level or byte-fallback tokens), that text is "pending":
part of ``output_text`` but never streamed until the request finishes. Emission points are
therefore UTF-8 sync points, which makes the concatenated text equal ``tokenizer.decode`` of the
output ids (for tokenizers whose decoding is local, i.e. all byte-level / byte-fallback BPEs).

One non-local case cannot be streamed exactly: a ByteFallback decoder turns a whole run of
byte tokens into U+FFFD when the run is not valid UTF-8, including characters of that run that
were complete (and so already streamed). Only broken model output hits this.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import tokenizers

from pagellm.sampling_params import SamplingParams

_REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded as the first window's context, so e.g. a SentencePiece "▁word" at the
# start of the output keeps its leading space as it would in the full text (vLLM uses 5).
_NUM_CONTEXT_TOKENS = 5
# A character spans at most 4 bytes, hence at most 4 tokens; a window still ending in U+FFFD
# after this many tokens holds genuinely invalid bytes, and is emitted as is rather than be
# re-decoded forever (which would make a garbage stream quadratic).
_MAX_PENDING_TOKENS = 32


def _make_decode(tokenizer: Any, skip_special_tokens: bool, spaces_between_special_tokens: bool) -> Callable[[list[int]], str]:
    """Fastest available ``ids -> text``: the Rust backend when there is one.

    Fast tokenizers ignore ``spaces_between_special_tokens`` (as ``transformers`` does); it is
    only passed on to slow tokenizers' ``decode``. Clean-up of tokenization spaces is never applied:
    it is not local (" ." -> ".") and corrupts BPE output.
    """
    backend = tokenizer if isinstance(tokenizer, tokenizers.Tokenizer) else getattr(tokenizer, "backend_tokenizer", None)
    if isinstance(backend, tokenizers.Tokenizer):
        def decode_fast(ids: list[int]) -> str:
            return backend.decode(ids, skip_special_tokens=skip_special_tokens)

        return decode_fast
    if not callable(getattr(tokenizer, "decode", None)):
        raise ValueError(f"tokenizer {type(tokenizer).__name__} has no decode method.")

    def decode_slow(ids: list[int]) -> str:
        return tokenizer.decode(
            ids,
            skip_special_tokens=skip_special_tokens,
            spaces_between_special_tokens=spaces_between_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    return decode_slow


class IncrementalDetokenizer:
    """Per-request output text, stop-string matching and stream-safe deltas."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        stop = list(stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop strings must be non-empty strings, got {stop!r}.")
        if min_tokens < 0:
            raise ValueError(f"min_tokens must be at least 0, got {min_tokens}.")
        self._decode = _make_decode(tokenizer, skip_special_tokens, spaces_between_special_tokens)
        self.stop = stop
        self.include_stop_str_in_output = include_stop_str_in_output
        self.min_tokens = min_tokens
        self.output_token_ids: list[int] = []
        # Which stop string ended the output, once one has.
        self.stop_reason: Optional[str] = None

        self._ids: list[int] = [int(t) for t in prompt_token_ids[-_NUM_CONTEXT_TOKENS:]]
        if self._ids and self._decode(self._ids).endswith(_REPLACEMENT_CHAR):
            # The prompt ends inside a character: as context it would misalign the first window.
            self._ids = []
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_len: Optional[int] = None  # len(decode(ids[prefix:read])), computed lazily
        self._text = ""  # text up to the read offset (emitted), after stop truncation
        self._pending = ""  # text past the read offset, ending in U+FFFD
        self._stream_offset = 0  # how much of _text get_next_output_text has returned

    @classmethod
    def from_sampling_params(
        cls, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> "IncrementalDetokenizer":
        return cls(
            tokenizer,
            prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
            stop=params.stop or (),
            include_stop_str_in_output=params.include_stop_str_in_output,
            min_tokens=params.min_tokens,
        )

    @property
    def output_text(self) -> str:
        """All text so far, including a trailing incomplete character (as U+FFFD)."""
        return self._text + self._pending

    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> Optional[str]:
        """Appends tokens; returns the stop string that ended the output, if one appeared.

        On a match the text is cut before the stop string (or after it with
        ``include_stop_str_in_output``); the caller must then finish the request. When
        ``stop_terminated`` (the last token is a stop token id, e.g. EOS), that token's text is
        left out unless ``include_stop_str_in_output``, as in vLLM.
        """
        if self.stop_reason is not None:
            raise ValueError(f"update after the output already stopped at {self.stop_reason!r}.")
        if not new_token_ids:
            return None
        # Plain ints: numpy / tensor scalars would not pass through the Rust decoder.
        new_token_ids = [int(t) for t in new_token_ids]
        to_decode = new_token_ids
        if stop_terminated and not self.include_stop_str_in_output:
            to_decode = new_token_ids[:-1]
        # Stop strings are only looked for in text of tokens past min_tokens.
        check_from = len(self._text)
        for token_id in to_decode:
            self.output_token_ids.append(token_id)
            self._decode_next(token_id)
            if len(self.output_token_ids) <= self.min_tokens:
                check_from = len(self._text)
        self.output_token_ids.extend(new_token_ids[len(to_decode) :])
        if not self.stop or check_from >= len(self._text):
            return None
        match = self._find_stop(check_from)
        if match is None:
            return None
        stop_str, start = match
        self._text = self._text[: start + len(stop_str) if self.include_stop_str_in_output else start]
        self._pending = ""
        self.stop_reason = stop_str
        return stop_str

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text that is safe to show: all of it when ``finished``, else what cannot change.

        Unfinished, it holds back a trailing incomplete character and the longest end of the text
        that could still grow into a stop string (at most len(longest stop) - 1 characters). With
        ``delta`` it returns only what earlier calls have not.
        """
        if finished:
            text = self.output_text
            safe_len = len(text)
        else:
            text = self._text
            safe_len = len(text) - self._stop_prefix_len(text)
        if not delta:
            return text[:safe_len]
        if safe_len <= self._stream_offset:
            return ""
        start, self._stream_offset = self._stream_offset, safe_len
        return text[start:safe_len]

    # ---- internals ------------------------------------------------------------------------

    def _decode_next(self, token_id: int) -> None:
        ids = self._ids
        ids.append(token_id)
        if self._prefix_len is None:
            self._prefix_len = len(self._decode(ids[self._prefix_offset : self._read_offset]))
        new_text = self._decode(ids[self._prefix_offset :])
        incomplete = new_text.endswith(_REPLACEMENT_CHAR) and len(ids) - self._read_offset < _MAX_PENDING_TOKENS
        if len(new_text) <= self._prefix_len or incomplete:
            self._pending = new_text[self._prefix_len :]
            return
        # Rebinding a local before += lets CPython grow the string in place (amortized O(1)).
        text, self._text = self._text, ""
        text += new_text[self._prefix_len :]
        self._text = text
        self._pending = ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        self._prefix_len = None
        if self._prefix_offset > 4 * _MAX_PENDING_TOKENS:
            # Drop ids no window will look at again, keeping memory O(window).
            del ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0

    def _find_stop(self, check_from: int) -> Optional[tuple[str, int]]:
        """The stop string whose match ends first in text from ``check_from`` on, and its start."""
        text = self._text
        best: Optional[tuple[int, int, str]] = None  # (end, start, stop string)
        for stop_str in self.stop:
            start = text.find(stop_str, max(0, check_from - len(stop_str) + 1))
            if start == -1:
                continue
            candidate = (start + len(stop_str), start, stop_str)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
        return None if best is None else (best[2], best[1])

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest end of ``text`` that is a proper prefix of some stop string."""
        if not self.stop or self.include_stop_str_in_output or self.stop_reason is not None:
            # Included stop strings may be streamed as they come; after a stop nothing grows.
            return 0
        longest = 0
        n = len(text)
        for stop_str in self.stop:
            start = n - min(len(stop_str) - 1, n)
            i = text.find(stop_str[0], start)
            while i != -1 and n - i > longest:
                if stop_str.startswith(text[i:]):
                    longest = n - i
                    break
                i = text.find(stop_str[0], i + 1)
        return longest
