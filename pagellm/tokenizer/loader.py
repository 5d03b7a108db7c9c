"""Loading the tokenizer of a Hugging Face directory or a GGUF file, offline.

A GGUF file's byte-level BPE vocabulary (``tokenizer.ggml.model == "gpt2"``: SmolLM2, Llama 3,
Qwen2) is built here with ``tokenizers`` from pagellm's own read of the file, as transformers'
GGUF conversion builds it (tests compare the two byte for byte), and served as a
:class:`~pagellm.tokenizer.fast.FastTokenizer`. That conversion, or transformers' tokenizer class
alone, would import transformers: interpreter time that a server's start would otherwise
spend beside the weights' packing. Other GGUF vocabularies go through ``PreTrainedTokenizerFast.from_pretrained(
gguf_file=...)``; only Hugging Face directories import ``AutoTokenizer``.
"""
from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE

from pagellm.models.gguf_loader import GGUFFile
from pagellm.models.loader import is_gguf, resolve_model_path
from pagellm.tokenizer.fast import FastTokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# How text is split before byte-level BPE, by the file's `tokenizer.ggml.pre`: the pre-tokenizer
# types whose split transformers' GGUF conversion knows (its GGUF_PRE_TOKENIZER_SPLITS, checked by
# the tests), and those it splits with GPT-2's own regular expression. Any other type is built by
# transformers.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
BYTE_LEVEL_SPLITS: dict[str, str] = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
GPT2_SPLIT_TYPES = frozenset({"default", "gpt-2", "smollm"})
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types
# GPT2Tokenizer's default unknown/BOS/EOS token, which transformers' conversion adds as special.
_GPT2_DEFAULT_SPECIAL = "<|endoftext|>"


@functools.lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of each byte, which byte-level BPE vocabularies are written in."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def load_tokenizer(model_path: str) -> FastTokenizer | PreTrainedTokenizerBase:
    """The model's tokenizer with its special tokens and chat template; never touches the network."""
    path = resolve_model_path(model_path)
    if is_gguf(path):
        tokenizer = byte_level_gguf_tokenizer(path)
        if tokenizer is not None:
            return tokenizer
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast.from_pretrained(
            os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path), local_files_only=True
        )
        _follow_gguf_bos_eos_flags(tokenizer, GGUFFile.cached(path).metadata)
    else:
        from transformers import AutoTokenizer  # its registry of every model's classes: HF directories only

        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return tokenizer


def _follow_gguf_bos_eos_flags(tokenizer: PreTrainedTokenizerBase, metadata: dict[str, Any]) -> None:
    """Add BOS / EOS to encoded text as the file says (llama.cpp does): transformers' conversion of a
    SentencePiece-style vocabulary (Gemma 4's "gemma4") drops the file's add_bos_token, and Gemma's
    output degrades without its BOS."""
    for flag in ("add_bos_token", "add_eos_token"):
        wanted = metadata.get(f"tokenizer.ggml.{flag}")
        if wanted is not None and getattr(tokenizer, flag, None) != bool(wanted):
            setattr(tokenizer, flag, bool(wanted))  # the setter rebuilds the post-processor


def byte_level_gguf_tokenizer(path: str) -> FastTokenizer | None:
    """The byte-level BPE tokenizer a GGUF file describes, as transformers' GGUF conversion builds
    it; None where the file's vocabulary is of another kind, or splits text in a way not known here."""
    # The kind is known from the table parsed once at start-up; only then are the strings read.
    described = GGUFFile.cached(path)
    pre = described.metadata.get("tokenizer.ggml.pre", "default")
    lengths = described.array_lengths
    if described.metadata.get("tokenizer.ggml.model") != "gpt2" or not lengths.get("tokenizer.ggml.tokens"):
        return None
    if "tokenizer.ggml.merges" not in lengths:
        return None
    if pre not in BYTE_LEVEL_SPLITS and pre not in GPT2_SPLIT_TYPES:
        return None
    metadata = GGUFFile(path, string_arrays=("tokenizer.ggml.tokens", "tokenizer.ggml.merges")).metadata
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    merges: list[str] = metadata["tokenizer.ggml.merges"]
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    # Tokens outside the byte alphabet (a special token's plain text) are looked up by their bytes' spelling.
    vocab = {
        token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")): index
        for index, token in enumerate(tokens)
    }
    if _GPT2_DEFAULT_SPECIAL not in vocab:
        return None  # transformers would add it as a new token; it builds that tokenizer itself
    backend = Tokenizer(
        BPE(
            vocab=vocab,
            merges=[tuple(merge.split(" ")) for merge in merges],
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre not in BYTE_LEVEL_SPLITS)
    if pre in BYTE_LEVEL_SPLITS:
        split = pre_tokenizers.Split(Regex(BYTE_LEVEL_SPLITS[pre]), behavior="isolated")
        backend.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    else:
        backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    # Control tokens stay whole and special; a control token spelled outside the byte alphabet is a
    # llama.cpp mislabel that transformers skips (adding it would grow the vocabulary), and so do we.
    # GPT2Tokenizer's default special token is special whatever the file calls it.
    token_types = metadata.get("tokenizer.ggml.token_type") or ()
    backend.add_special_tokens(
        [AddedToken(_GPT2_DEFAULT_SPECIAL, normalized=False, special=True)]
        + [
            AddedToken(token, normalized=False, special=True)
            for token, kind in zip(tokens, token_types)
            if kind == _CONTROL and set(token) <= alphabet
        ]
    )
    user_defined = [
        AddedToken(token, normalized=False, special=False)
        for token, kind in zip(tokens, token_types)
        if kind == _USER_DEFINED and token in vocab
    ]
    if user_defined:
        backend.add_tokens(user_defined)

    def token_at(key: str) -> str | None:
        index = metadata.get(f"tokenizer.ggml.{key}")
        return tokens[index] if index is not None else None

    kwargs: dict[str, Any] = {
        "name_or_path": path,
        "bos_token": token_at("bos_token_id"),
        "eos_token": token_at("eos_token_id"),
        "unk_token": token_at("unknown_token_id"),
        "pad_token": token_at("padding_token_id"),
    }
    if "tokenizer.chat_template" in metadata:
        kwargs["chat_template"] = metadata["tokenizer.chat_template"]
    for flag in ("add_bos_token", "add_eos_token"):
        if f"tokenizer.ggml.{flag}" in metadata:
            kwargs[flag] = bool(metadata[f"tokenizer.ggml.{flag}"])
    return FastTokenizer(backend, **kwargs)


def render_chat(
    tokenizer: FastTokenizer | PreTrainedTokenizerBase,
    messages: Sequence[dict[str, Any]],
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    **template_kwargs: Any,
) -> str:
    """The prompt text the model's chat template makes of ``messages``."""
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; pass one or send a plain prompt.")
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts.")
    for message in messages:
        if not isinstance(message, dict) or "role" not in message:
            raise ValueError(f"each message must be a dict with a 'role', got {message!r}.")
    return tokenizer.apply_chat_template(
        list(messages),
        add_generation_prompt=add_generation_prompt,
        chat_template=chat_template,
        tokenize=False,
        **template_kwargs,
    )


def apply_chat_template(
    tokenizer: FastTokenizer | PreTrainedTokenizerBase,
    messages: Sequence[dict[str, Any]],
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    **template_kwargs: Any,
) -> list[int]:
    """Token ids of the chat prompt for ``messages``.

    The template writes any BOS itself, so the text is encoded without adding special tokens
    (as vLLM does); otherwise templates like Llama 3's would get two BOS tokens.
    """
    text = render_chat(tokenizer, messages, add_generation_prompt, chat_template, **template_kwargs)
    return list(tokenizer.encode(text, add_special_tokens=False))
