"""Reasoning marked by strings in the text (``<think>...</think>``, Granite's phrases, Gemma 4's channel).

One state machine reads a reply whole or in pieces: whole extraction is the machine fed the whole
reply at once, so streamed pieces always join into the whole result. A parser is a ``TagSyntax``
(its markers and quirks) plus how the reply begins: inside reasoning (the template opened it, or the
model may omit the start marker) or in content (the reasoning section must be opened by the model).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from pagellm.reasoning.base import ReasoningBoundaryStrings, ReasoningDelta, ReasoningParser, config_strings, decode, token_pieces

# (position, decided): where an implicit end of reasoning begins in the text; decided=False means
# it may be one, and the text from there must be held until more arrives.
ImplicitEnd = Callable[[str, bool], Optional[tuple[int, bool]]]


@dataclass(frozen=True)
class TagSyntax:
    starts: tuple[str, ...]
    ends: tuple[str, ...]
    # A required start may follow content (Gemma 4); otherwise only whitespace may precede it.
    start_anywhere: bool = False
    # An end marker met in content before any start is dropped (Gemma 4's stray ``<channel|>``).
    drop_stray_ends: bool = False
    # A label the model writes first inside reasoning, dropped (Gemma 4's ``thought\n``).
    reasoning_label: str = ""
    # An empty reasoning section is reported as None rather than "".
    empty_reasoning_is_none: bool = False
    implicit_end: Optional[ImplicitEnd] = None
    implicit_markers: tuple[str, ...] = ()


def held_back(text: str, markers: Sequence[str]) -> int:
    """How much of ``text`` may go out while none of ``markers`` is in it: all but a tail that could
    begin one."""
    keep = len(text)
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), 0, -1):
            if marker.startswith(text[-k:]):
                keep = min(keep, len(text) - k)
                break
    return keep


def _find_first(text: str, markers: Sequence[str]) -> tuple[int, int]:
    """(index, length) of the earliest marker in text, (-1, 0) if none."""
    best, length = -1, 0
    for marker in markers:
        i = text.find(marker)
        if i >= 0 and (best < 0 or i < best):
            best, length = i, len(marker)
    return best, length


_INIT, _PRE, _REASONING, _CONTENT = "init", "pre", "reasoning", "content"


@dataclass
class TagMachine:
    """Reads one reply. ``reasoning_first``: the reply begins inside reasoning (a start marker at its
    beginning is optional); otherwise it begins in content and only a start marker opens reasoning."""

    syntax: TagSyntax
    reasoning_first: bool
    state: str = _INIT
    buf: str = ""
    pos: int = 0  # offset of buf in the whole reply
    entered: bool = False  # a reasoning section was opened (or assumed)
    label_done: bool = False
    spans: list[tuple[int, int]] = field(default_factory=list)  # reasoning's character ranges in the reply
    reasoning: list[str] = field(default_factory=list)
    content: list[str] = field(default_factory=list)

    def _take(self, n: int) -> str:
        out, self.buf, self.pos = self.buf[:n], self.buf[n:], self.pos + n
        return out

    def _emit_reasoning(self, n: int, out: ReasoningDelta) -> None:
        if n:
            if self.spans and self.spans[-1][1] == self.pos:
                self.spans[-1] = (self.spans[-1][0], self.pos + n)
            else:
                self.spans.append((self.pos, self.pos + n))
            out.reasoning += self._take(n)

    def _emit_content(self, n: int, out: ReasoningDelta) -> None:
        if n:
            out.content += self._take(n)

    def _enter(self, drop: int) -> None:
        self._take(drop)
        self.state, self.entered = _REASONING, True
        self.label_done = not self.syntax.reasoning_label

    def _start_at(self, text: str) -> int:
        """Length of the start marker that ``text`` begins with, 0 if none."""
        return next((len(s) for s in self.syntax.starts if text.startswith(s)), 0)

    def feed(self, text: str, final: bool = False) -> ReasoningDelta:
        out = ReasoningDelta()
        self.buf += text
        syn = self.syntax
        while True:
            if self.state == _INIT:
                if not self.reasoning_first and syn.start_anywhere:
                    self.state = _PRE
                    continue
                rest = self.buf.lstrip()
                # Whitespace before a start marker is the template's, not reasoning or content.
                if m := self._start_at(rest):
                    self._enter(len(self.buf) - len(rest) + m)
                    continue
                if not final and (not rest or any(s.startswith(rest) for s in syn.starts)):
                    break
                if self.reasoning_first:
                    self.state, self.entered = _REASONING, True
                    self.label_done = not syn.reasoning_label
                else:
                    self.state = _CONTENT
            elif self.state == _PRE:
                markers = syn.starts + (syn.ends if syn.drop_stray_ends else ())
                i, length = _find_first(self.buf, markers)
                if i >= 0:
                    self._emit_content(i, out)
                    if self._start_at(self.buf):
                        self._enter(length)
                    else:
                        self._take(length)
                    continue
                self._emit_content(len(self.buf) if final else held_back(self.buf, markers), out)
                break
            elif self.state == _REASONING:
                if not self.label_done:
                    label = syn.reasoning_label
                    if self.buf.startswith(label):
                        self._take(len(label))
                    elif not final and label.startswith(self.buf):
                        break
                    self.label_done = True
                    continue
                i, length = _find_first(self.buf, syn.ends)
                implicit = syn.implicit_end(self.buf, final) if syn.implicit_end else None
                if implicit is not None and (i < 0 or implicit[0] < i):
                    if implicit[1]:
                        # The implicit marker (a tool call) stays in the content, where its parser reads it.
                        self._emit_reasoning(implicit[0], out)
                        self.state = _CONTENT
                        continue
                    self._emit_reasoning(min(implicit[0], held_back(self.buf, syn.ends + syn.implicit_markers)), out)
                    break
                if i >= 0:
                    self._emit_reasoning(i, out)
                    self._take(length)
                    self.state = _CONTENT
                    continue
                self._emit_reasoning(len(self.buf) if final else held_back(self.buf, syn.ends + syn.implicit_markers), out)
                break
            else:
                self._emit_content(len(self.buf), out)
                break
        self.reasoning.append(out.reasoning)
        self.content.append(out.content)
        return out

    def result(self) -> tuple[Optional[str], Optional[str]]:
        reasoning: Optional[str] = "".join(self.reasoning) if self.entered else None
        if reasoning == "" and self.syntax.empty_reasoning_is_none:
            reasoning = None
        return reasoning, "".join(self.content) or None


def last_marker(text: str, starts: Sequence[str], ends: Sequence[str]) -> Optional[str]:
    """ "start" or "end": which kind of marker comes last in text; None if neither is in it."""
    s = max((text.rfind(m) for m in starts), default=-1)
    e = max((text.rfind(m) for m in ends), default=-1)
    if s < 0 and e < 0:
        return None
    return "start" if s > e else "end"


class TagReasoningParser(ReasoningParser):
    """A reasoning parser on string markers. Subclasses set ``syntax``, ``reasoning_first`` (whether a
    reply with no marker is reasoning) and ``boundary`` (the engine's strings)."""

    syntax: TagSyntax
    reasoning_first: bool = True
    boundary: ReasoningBoundaryStrings
    # The last tokens of the prompt read for a marker: the generation prompt and the turn before it.
    PROMPT_TAIL_TOKENS = 256

    def __init__(
        self,
        tokenizer: Any = None,
        prompt_token_ids: Sequence[int] = (),
        chat_template_kwargs: Optional[dict[str, Any]] = None,
        reasoning_config: Optional[dict[str, Any]] = None,
    ) -> None:
        super().__init__(tokenizer, prompt_token_ids, chat_template_kwargs, reasoning_config)
        self._reasoning_first = self._begins_in_reasoning()
        self._stream = self._machine()

    def _machine(self) -> TagMachine:
        return TagMachine(self.syntax, self._reasoning_first)

    def thinking_disabled(self) -> bool:
        """Whether the chat template was told not to think (Qwen's ``enable_thinking``, DeepSeek's ``thinking``)."""
        kw = self.chat_template_kwargs
        return kw.get("enable_thinking", True) is False or kw.get("thinking", True) is False

    def _begins_in_reasoning(self) -> bool:
        """A prompt whose last marker opens reasoning (DeepSeek-R1's and Qwen 3.5's ``<think>\\n``)
        leaves the reply inside it; one whose last marker closes it (Qwen 3 with thinking off writes
        ``<think>\\n\\n</think>\\n\\n``) leaves it in content; otherwise the parser's default holds."""
        if self.tokenizer is not None and self.prompt_token_ids:
            tail = decode(self.tokenizer, self.prompt_token_ids[-self.PROMPT_TAIL_TOKENS :])
            kind = last_marker(tail, self.syntax.starts, self.syntax.ends)
            if kind is not None:
                return kind == "start"
        return self.reasoning_first and not self.thinking_disabled()

    @classmethod
    def boundary_strings(cls, reasoning_config: Optional[dict[str, Any]] = None) -> ReasoningBoundaryStrings:
        # As vLLM's ReasoningConfig: the configured strings replace the start and the forced end;
        # the end that the model writes itself stays the parser's.
        start, end = config_strings(reasoning_config)
        b = cls.boundary
        return ReasoningBoundaryStrings(start or b.start, b.end, end or b.forced_end)

    def extract_reasoning(self, text: str, token_ids: Sequence[int] = ()) -> tuple[Optional[str], Optional[str]]:
        machine = self._machine()
        machine.feed(text, final=True)
        return machine.result()

    def extract_reasoning_streaming(self, delta_text: str, delta_token_ids: Sequence[int] = ()) -> ReasoningDelta:
        return self._stream.feed(delta_text)

    def finish(self) -> ReasoningDelta:
        return self._stream.feed("", final=True)

    def num_reasoning_tokens(self, output_token_ids: Sequence[int]) -> int:
        if not output_token_ids:
            return 0
        if self.tokenizer is None:
            raise ValueError(f"the {self.name} reasoning parser needs the tokenizer to count reasoning tokens")
        pieces = token_pieces(self.tokenizer, output_token_ids)
        machine = self._machine()
        machine.feed("".join(pieces), final=True)
        count, offset = 0, 0
        for piece in pieces:
            # A token ending inside a character counts with the character that follows.
            lo, hi = offset, offset + max(len(piece), 1)
            if any(a < hi and lo < b for a, b in machine.spans):
                count += 1
            offset += len(piece)
        return count
