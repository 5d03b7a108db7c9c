"""Tokenizer loading from the default GGUF and from an HF directory, against transformers."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from pagellm.models.gguf_loader import GGUFFile
from pagellm.models.loader import default_model_path
from pagellm.tokenizer import apply_chat_template, load_tokenizer, render_chat

pytestmark = pytest.mark.slow  # builds the real 49k-token tokenizer twice

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "  leading spaces,\ttabs and\nnew lines\n\n",
    "中文分词测试：你好，世界！",
    "emoji 🙂🚀👩‍👩‍👧 and ZWJ sequences",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
    "numbers 1234567 3.14159 and code: def f(x): return x**2",
]
MESSAGES = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def ours() -> PreTrainedTokenizerBase:
    return load_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def theirs() -> PreTrainedTokenizerBase:
    path = default_model_path()
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path), local_files_only=True)


def test_gguf_tokenizer_loads_fast() -> None:
    start = time.perf_counter()
    load_tokenizer(default_model_path())
    seconds = time.perf_counter() - start
    print(f"GGUF tokenizer load: {seconds:.2f}s")
    assert seconds < 15  # ~0.6 s once transformers is imported


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_tokenizer_encodes_and_decodes_like_transformers(
    text: str, ours: PreTrainedTokenizerBase, theirs: PreTrainedTokenizerBase
) -> None:
    ids = ours.encode(text)
    assert ids == theirs.encode(text)
    assert ours.decode(ids) == theirs.decode(ids) == text
    assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)


def test_special_tokens_and_vocab(ours: PreTrainedTokenizerBase, theirs: PreTrainedTokenizerBase) -> None:
    assert len(ours) == len(theirs) == 49152
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id, ours.unk_token_id) == (1, 2, 2, 0)
    assert ours.eos_token == "<|im_end|>"
    assert ours.all_special_tokens == theirs.all_special_tokens
    assert ours.encode("<|im_start|>") == [1]  # kept whole, not split into pieces
    assert ours.backend_tokenizer.to_str() == theirs.backend_tokenizer.to_str()


def test_chat_template_from_gguf_metadata(ours: PreTrainedTokenizerBase) -> None:
    assert ours.chat_template == GGUFFile(default_model_path()).metadata["tokenizer.chat_template"]
    text = render_chat(ours, MESSAGES)
    assert text.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    ids = apply_chat_template(ours, MESSAGES)
    assert ids[0] == 1 and ids.count(1) == 3  # system, user, assistant turns; no extra BOS
    assert ours.decode(ids) == text
    no_prompt = render_chat(ours, MESSAGES, add_generation_prompt=False)
    assert not no_prompt.endswith("<|im_start|>assistant\n")


def test_chat_template_input_errors(ours: PreTrainedTokenizerBase) -> None:
    with pytest.raises(ValueError, match="'role'"):
        apply_chat_template(ours, [{"content": "no role"}])
    with pytest.raises(ValueError, match="list of"):
        apply_chat_template(ours, "just a string")  # type: ignore[arg-type]


def test_hf_directory_tokenizer_round_trips(ours: PreTrainedTokenizerBase, tmp_path: Path) -> None:
    ours.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}')
    reloaded = load_tokenizer(str(tmp_path))
    for text in TEXTS:
        assert reloaded.encode(text) == ours.encode(text)
    assert reloaded.chat_template == ours.chat_template
    assert reloaded.eos_token_id == 2
    assert apply_chat_template(reloaded, MESSAGES) == apply_chat_template(ours, MESSAGES)


def test_directory_holding_only_the_gguf_resolves_to_it(tmp_path: Path) -> None:
    os.symlink(default_model_path(), tmp_path / "model.gguf")
    assert load_tokenizer(str(tmp_path)).encode("hi there") == load_tokenizer(default_model_path()).encode("hi there")


def test_byte_level_splits_are_transformers_own() -> None:
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    from pagellm.tokenizer import BYTE_LEVEL_SPLITS, GPT2_SPLIT_TYPES

    assert {name: GGUF_PRE_TOKENIZER_SPLITS[name] for name in BYTE_LEVEL_SPLITS} == BYTE_LEVEL_SPLITS
    assert not GPT2_SPLIT_TYPES & set(GGUF_PRE_TOKENIZER_SPLITS)  # transformers splits these as GPT-2 does


def _write_vocabulary_gguf(
    path: Path, pre: str, user_defined: tuple[int, ...] = (), drop_endoftext: bool = False, plain: tuple[int, ...] = ()
) -> Path:
    """A GGUF holding only the default model's vocabulary, with another pre-tokenizer type and the
    tokens at ``user_defined`` and ``plain`` typed as user-defined and normal."""
    import gguf

    source = GGUFFile(default_model_path(), string_arrays=("tokenizer.ggml.tokens", "tokenizer.ggml.merges")).metadata
    tokens = list(source["tokenizer.ggml.tokens"])
    token_types = list(source["tokenizer.ggml.token_type"])
    for index in user_defined:
        token_types[index] = 4
    for index in plain:
        token_types[index] = 1
    if drop_endoftext:
        tokens[0] = "<|end_of_text|>"  # Llama 3's spelling: GPT-2's default special token is absent
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(source["tokenizer.ggml.merges"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_chat_template(source["tokenizer.chat_template"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    "pre, user_defined, drop_endoftext, plain, built_here",
    [
        ("llama-bpe", (), False, (), True),
        ("qwen2", (4, 7), False, (), True),
        ("smollm", (5,), False, (0, 3), True),  # <|endoftext|> typed normal: special all the same
        ("llama-bpe", (), True, (), False),  # transformers would add <|endoftext|> as a new token
        ("tekken", (), False, (), False),  # a split not known here
    ],
)
def test_byte_level_gguf_tokenizer_is_transformers_conversion(
    tmp_path: Path, pre: str, user_defined: tuple[int, ...], drop_endoftext: bool, plain: tuple[int, ...], built_here: bool
) -> None:
    from transformers import PreTrainedTokenizerFast

    from pagellm.tokenizer import byte_level_gguf_tokenizer

    path = _write_vocabulary_gguf(tmp_path / "vocab.gguf", pre, user_defined, drop_endoftext, plain)
    assert (byte_level_gguf_tokenizer(str(path)) is not None) == built_here
    ours = load_tokenizer(str(path))
    theirs = PreTrainedTokenizerFast.from_pretrained(str(tmp_path), gguf_file="vocab.gguf", local_files_only=True)
    assert ours.backend_tokenizer.to_str() == theirs.backend_tokenizer.to_str()
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert getattr(ours, name) == getattr(theirs, name)
    assert ours.chat_template == theirs.chat_template
    for text in [*TEXTS, "digits 1234567890 split by the pre-tokenizer's rule"]:
        assert ours.encode(text) == theirs.encode(text)
        assert ours.decode(ours.encode(text)) == theirs.decode(theirs.encode(text))
    assert apply_chat_template(ours, MESSAGES) == apply_chat_template(theirs, MESSAGES)


def test_byte_spelling_is_transformers_own() -> None:
    from transformers.convert_slow_tokenizer import bytes_to_unicode as theirs

    from pagellm.tokenizer import bytes_to_unicode

    assert bytes_to_unicode() == theirs()
