"""gpt-oss's harmony reasoning parser (openai_gptoss / gpt_oss), and the o200k file it needs.

is_reasoning_end's cases port vLLM's tests/reasoning/test_gptoss_reasoning_parser.py @ 0985a564 (TEST_CASES) as
our own data; vLLM has no extraction cases for this parser (its serving layer parses harmony itself), so the
whole / streamed cases are pagellm's."""

from __future__ import annotations

import base64

import pytest
from harmony_fixture import SHARE, harmony_or_skip
from openai_harmony import Conversation, Message, Role

from pagellm.reasoning import get_reasoning_parser
from pagellm.reasoning.harmony_vocab import FILE_NAME, SHA256, byte_to_unicode, o200k_lines_from_vocab, write_o200k


@pytest.fixture
def enc(monkeypatch):
    return harmony_or_skip(monkeypatch)


USER = "<|start|>user<|message|>"
ANALYSIS = "<|end|><|start|>assistant<|channel|>analysis<|message|>"
END = "<|end|>"
ASSISTANT = "<|start|>assistant"
FINAL_PREFIX = END + ASSISTANT + "<|channel|>final"
MSG = "<|message|>"

IS_REASONING_END = [
    ("basic_content", ANALYSIS + "Thinking it over" + FINAL_PREFIX + MSG + "Here you go", True),
    ("basic_reasoning_only", ANALYSIS + "Thinking it over" + END, False),
    ("complex_content_incomplete_prefix_only", ANALYSIS + "Thinking it over" + FINAL_PREFIX, False),
    ("complex_content_suffix_only", ANALYSIS + "Thinking it over" + MSG, False),
    ("complex_content_1_no_suffix", ANALYSIS + "Thinking it over" + FINAL_PREFIX + "<|constrain|> JSON ", False),
    ("complex_content_1", ANALYSIS + "Thinking it over" + FINAL_PREFIX + "<|constrain|> JSON " + MSG, True),
    ("complex_content_1_with_content", ANALYSIS + "Thinking it over" + FINAL_PREFIX + "<|constrain|> JSON " + MSG + "{}", True),
    ("complex_content_2", ANALYSIS + "Thinking it over" + FINAL_PREFIX + "<|constrain|>Reply " + MSG + "Here you go", True),
    (
        "multi_turn_content",
        USER
        + "first question"
        + ANALYSIS
        + "first thoughts"
        + FINAL_PREFIX
        + MSG
        + "first answer"
        + END
        + USER
        + "second question"
        + END
        + ASSISTANT,
        False,
    ),
]


@pytest.mark.parametrize("text, want", [pytest.param(t, w, id=i) for i, t, w in IS_REASONING_END])
def test_is_reasoning_end(enc, text, want):
    parser = get_reasoning_parser("openai_gptoss")()
    assert parser.is_reasoning_end(enc.encode(text, allowed_special="all")) is want


def reply_ids(enc, *messages: Message) -> list[int]:
    """The reply's tokens as the model writes them after the prompt's <|start|>assistant."""
    convo = Conversation.from_messages([Message.from_role_and_content(Role.USER, "What is 2+2?"), *messages])
    prompt = enc.render_conversation_for_completion(Conversation.from_messages(convo.messages[:1]), Role.ASSISTANT)
    whole = enc.render_conversation_for_completion(convo, Role.ASSISTANT)
    return whole[len(prompt) : -2]  # less the next turn's <|start|>assistant


def analysis(text: str) -> Message:
    return Message.from_role_and_content(Role.ASSISTANT, text).with_channel("analysis")


def final(text: str) -> Message:
    return Message.from_role_and_content(Role.ASSISTANT, text).with_channel("final")


CASES = [
    (
        "reasoning_then_answer",
        [analysis("Add two and two. Naïve check: 4.")],
        "<|start|>assistant<|channel|>final<|message|>Four.",
        ("Add two and two. Naïve check: 4.", "Four."),
    ),
    ("reasoning_cut_short", [], "<|channel|>analysis<|message|>Still thinking about ünïcode", ("Still thinking about ünïcode", None)),
    ("answer_only", [], "<|channel|>final<|message|>Just 4<|return|>", (None, "Just 4")),
    ("header_cut_short", [], "<|channel|>analysis<|message|>Hm<|end|><|start|>assistant<|channel|>fi", ("Hm", None)),
]


@pytest.mark.parametrize("messages, tail, want", [pytest.param(m, t, w, id=i) for i, m, t, w in CASES])
def test_extract_whole_and_streamed(enc, messages, tail, want):
    ids = (reply_ids(enc, *messages) if messages else []) + enc.encode(tail, allowed_special="all")
    cls = get_reasoning_parser("gpt_oss")
    # Token ids carry the structure: the text may have lost its special tokens.
    assert cls().extract_reasoning("stripped text", ids) == want
    assert cls().extract_reasoning(enc.decode(ids)) == want  # no ids: the text with its special tokens
    for size in (1, 2, 3, 7, len(ids)):
        parser, r, c = cls(), "", ""
        for i in range(0, len(ids), size):
            d = parser.extract_reasoning_streaming("", ids[i : i + size])
            r, c = r + d.reasoning, c + d.content
        d = parser.finish()
        assert (r + d.reasoning, c + d.content) == (want[0] or "", want[1] or ""), size


def test_num_reasoning_tokens_and_prompt_prefill(enc):
    cls = get_reasoning_parser("gpt_oss")
    thought = enc.encode("Add two and two.", allowed_special="all")
    ids = (
        enc.encode("<|channel|>analysis<|message|>", allowed_special="all")
        + thought
        + enc.encode("<|end|><|start|>assistant<|channel|>final<|message|>4<|return|>", allowed_special="all")
    )
    assert cls().num_reasoning_tokens(ids) == len(thought)
    # A prompt that already opened the analysis channel: the reply is its text.
    prompt = enc.encode("<|start|>user<|message|>Hi<|end|><|start|>assistant<|channel|>analysis<|message|>", allowed_special="all")
    assert cls(prompt_token_ids=prompt).extract_reasoning("", thought + ids[len(thought) + 3 :]) == ("Add two and two.", "4")


class VocabTokenizer:
    """A byte-level BPE tokenizer's vocabulary, made from the o200k file itself."""

    def __init__(self, vocab: dict[str, int]) -> None:
        self._vocab = vocab

    def get_vocab(self) -> dict[str, int]:
        return self._vocab


def test_o200k_file_from_an_hf_vocabulary(tmp_path, enc):
    to_char = byte_to_unicode()
    vocab = {}
    for line in (SHARE / FILE_NAME).read_bytes().splitlines():
        token, rank = line.split()
        vocab["".join(to_char[b] for b in base64.b64decode(token))] = int(rank)
    vocab["<|start|>"] = 200006  # special tokens past the ranks are ignored
    assert write_o200k(VocabTokenizer(vocab), tmp_path) == tmp_path
    assert (tmp_path / FILE_NAME).read_bytes() == (SHARE / FILE_NAME).read_bytes()
    del vocab["!"]
    with pytest.raises(ValueError, match="lacks 1 of o200k"):
        o200k_lines_from_vocab(vocab)
    vocab["!"] = 0
    vocab[next(k for k, v in vocab.items() if v == 5)] = 6  # two tokens on one rank: another vocabulary
    with pytest.raises(ValueError, match=f"not {SHA256}|lacks"):
        write_o200k(VocabTokenizer(vocab), tmp_path / "other")
