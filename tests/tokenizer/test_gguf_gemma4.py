"""A Gemma 4 GGUF's tokenizer (tokenizer model "gemma4", as llama.cpp's converter writes it) against
the Hugging Face tokenizer it was converted from.

fixtures/gemma4/hf: a tokenizer in Gemma's format (BPE with byte fallback, spaces as "▁", Gemma 4's turn
tokens; 1,024 tokens, the recipe of scripts/make_gemma4_checkpoint.py --tokenizer-only
--vocab-size 1024 --learned 600, whose merges depend on the Python whose stdlib it learns from) and vocab.gguf, the tokenizer keys
that llama.cpp's convert_hf_to_gguf.py wrote for a tiny Gemma 4 checkpoint holding it (its tensors
dropped)."""
from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from pagellm.models.gguf_loader import GGUFFile
from pagellm.tokenizer import apply_chat_template, load_tokenizer, turn_end_token_ids

FIXTURE = Path(__file__).parent / "fixtures" / "gemma4"
TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "  leading spaces,\ttabs and\nnew lines\n\n",
    "中文分词测试：你好，世界！",
    "emoji 🙂🚀 and <|turn>user\nspecial tokens inline<turn|>",
    "numbers 1234567 3.14159 and code: def f(x): return x**2",
]


@pytest.fixture(scope="module")
def ours():
    return load_tokenizer(str(FIXTURE / "vocab.gguf"))


@pytest.fixture(scope="module")
def theirs():
    return AutoTokenizer.from_pretrained(str(FIXTURE / "hf"), local_files_only=True)


def test_fixture_is_the_converters_gemma4_vocabulary() -> None:
    metadata = GGUFFile(str(FIXTURE / "vocab.gguf")).metadata
    assert metadata["tokenizer.ggml.model"] == "gemma4"
    assert metadata["tokenizer.ggml.add_bos_token"] is True


@pytest.mark.parametrize("text", TEXTS)
def test_encodes_and_decodes_like_the_hf_tokenizer(ours, theirs, text: str) -> None:
    ids = ours.encode(text)
    assert ids == theirs.encode(text)
    assert ids[0] == theirs.bos_token_id  # the file's add_bos_token, which transformers' conversion drops
    assert ours.decode(ids) == theirs.decode(ids)
    assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)


def test_special_tokens_chat_and_turn_end(ours, theirs) -> None:
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert getattr(ours, name) == getattr(theirs, name)
    messages = [{"role": "user", "content": "What is 2+2?"}]
    assert apply_chat_template(ours, messages) == apply_chat_template(theirs, messages)
    assert turn_end_token_ids(ours) == turn_end_token_ids(theirs) == {theirs.convert_tokens_to_ids("<turn|>")}
