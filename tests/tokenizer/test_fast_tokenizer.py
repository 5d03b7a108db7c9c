"""FastTokenizer against transformers' PreTrainedTokenizerFast over the same backend, and a GGUF
server's start-up path without transformers."""
from __future__ import annotations

import subprocess
import sys

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE
from transformers import PreTrainedTokenizerFast

from pagellm.tokenizer.fast import FastTokenizer

VOCAB = {"<unk>": 0, "<s>": 1, "</s>": 2, "h": 3, "e": 4, "l": 5, "o": 6, "he": 7, "ll": 8, "hell": 9, "hello": 10, "Ġ": 11}
MERGES = [("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o")]
TEXTS = ["hello", "hello hello", "<s>hello</s>", "", "oh"]


def backend(extra_special: tuple[str, ...] = ()) -> Tokenizer:
    tok = Tokenizer(BPE(vocab=dict(VOCAB), merges=list(MERGES), unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>", *extra_special)])
    return tok


def pair(post_processor: bool = False, **kwargs) -> tuple[FastTokenizer, PreTrainedTokenizerFast]:
    """Ours and transformers' over copies of one backend, built with the same arguments
    (``post_processor``: the backend comes with one of its own)."""
    tok = backend()
    if post_processor:
        tok.post_processor = processors.TemplateProcessing(single="<s>:0 $A:0", pair="$A:0 $B:1", special_tokens=[("<s>", 1)])
    source = tok.to_str()
    theirs = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(source), **kwargs)
    return FastTokenizer(Tokenizer.from_str(source), **kwargs), theirs


CONFIGS = [
    {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "</s>"},
    {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True},
    {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "add_eos_token": True},
    {"bos_token": "<s>", "eos_token": "<|new_eos|>", "unk_token": "<unk>"},  # an EOS the vocabulary lacks is added
    {"eos_token": "</s>", "add_bos_token": True},  # no BOS to add
    {"bos_token": "<s>", "eos_token": "</s>", "post_processor": True},  # the backend's own is kept
    {"bos_token": "<s>", "eos_token": "</s>", "post_processor": True, "add_bos_token": False},  # ... unless a flag is stated
]


@pytest.mark.parametrize("kwargs", CONFIGS)
def test_backend_and_encoding_are_transformers(kwargs) -> None:
    ours, theirs = pair(name_or_path="x.gguf", **kwargs)
    assert ours.backend_tokenizer.to_str() == theirs.backend_tokenizer.to_str()
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == theirs.encode(text, add_special_tokens=special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
                tokens = ours.convert_ids_to_tokens(ids, skip_special_tokens=skip)
                assert tokens == theirs.convert_ids_to_tokens(ids, skip_special_tokens=skip)
    assert ours.convert_ids_to_tokens(10) == theirs.convert_ids_to_tokens(10) == "hello"
    assert ours.convert_tokens_to_ids(["hello", "<s>"]) == theirs.convert_tokens_to_ids(["hello", "<s>"])
    assert ours.get_vocab() == theirs.get_vocab()
    assert (len(ours), ours.vocab_size) == (len(theirs), theirs.vocab_size)
    assert ours.special_tokens_map == theirs.special_tokens_map
    assert ours.all_special_tokens == theirs.all_special_tokens
    assert ours.all_special_ids == theirs.all_special_ids
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert getattr(ours, name) == getattr(theirs, name), name
        assert getattr(ours, f"{name}_id") == getattr(theirs, f"{name}_id"), name


def test_anything_else_is_served_by_the_transformers_tokenizer() -> None:
    ours, theirs = pair(bos_token="<s>", eos_token="</s>", add_bos_token=True)
    assert ours.hf is ours.hf  # built once
    assert ours("hello hello")["input_ids"] == theirs("hello hello")["input_ids"]
    assert ours.model_max_length == theirs.model_max_length
    chat = ([{"role": "user", "content": "hello"}],)
    kwargs = {"chat_template": "{{ messages[0].content }}"}
    assert ours.apply_chat_template(*chat, **kwargs)["input_ids"] == theirs.apply_chat_template(*chat, **kwargs)["input_ids"] == [10]
    with pytest.raises(AttributeError):
        ours.no_such_attribute  # noqa: B018


def test_unknown_special_token_names_are_refused() -> None:
    with pytest.raises(TypeError, match="unknown special token"):
        FastTokenizer(backend(), eos="</s>")


def test_a_gguf_server_starts_without_transformers() -> None:
    """The config, the tokenizer, the chat template and the server's modules of a GGUF model: none
    imports transformers (over a second of a start-up)."""
    code = (
        "import sys\n"
        "import pagellm.entrypoints.openai.api_server, pagellm.engine.llm_engine\n"
        "from pagellm.models.loader import default_model_path, load_hf_config, get_model_class\n"
        "from pagellm.tokenizer import load_tokenizer, render_chat\n"
        "path = default_model_path()\n"
        "get_model_class(load_hf_config(path))\n"
        "text = render_chat(load_tokenizer(path), [{'role': 'user', 'content': 'hi'}])\n"
        "assert text.endswith('<|im_start|>assistant\\n'), text\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"
