"""The stop token a chat template implies (pagellm.tokenizer.stop_tokens), on small tokenizers in
Gemma's format and on the default model's GGUF vocabulary."""
from __future__ import annotations

import pytest
from transformers import GemmaTokenizer

from pagellm.models.loader import default_model_path
from pagellm.tokenizer import load_tokenizer, turn_end_token_ids

GEMMA4_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<|turn>' + role + '\n' + message['content'] | trim + '<turn|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|turn>model\n' }}{% endif %}"
)


def _gemma_format(template: str | None, specials: list[str]) -> GemmaTokenizer:
    """A Gemma-format tokenizer (BPE with byte fallback) over single letters and ``specials``."""
    vocab = {name: index for index, name in enumerate(["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"])}
    for piece in [*(f"<0x{b:02X}>" for b in range(256)), "▁", *"abcdefghijklmnopqrstuvwxyz-\n"]:
        vocab.setdefault(piece, len(vocab))
    tokenizer = GemmaTokenizer(vocab=vocab, merges=[])
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    tokenizer.chat_template = template
    return tokenizer


def test_gemma4_turn_end() -> None:
    tokenizer = _gemma_format(GEMMA4_TEMPLATE, ["<|turn>", "<turn|>"])
    assert turn_end_token_ids(tokenizer) == {tokenizer.convert_tokens_to_ids("<turn|>")}
    assert tokenizer.eos_token_id not in turn_end_token_ids(tokenizer)


def test_default_model_gguf_turn_end_is_its_eos() -> None:
    tokenizer = load_tokenizer(default_model_path())
    assert turn_end_token_ids(tokenizer) == {tokenizer.eos_token_id} == {tokenizer.convert_tokens_to_ids("<|im_end|>")}


@pytest.mark.parametrize(
    "template, specials",
    [
        (None, []),
        # plain text after the content: no special token to stop on
        ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}", []),
        # a template that refuses the conversation (it wants a system turn first)
        ("{% if messages[0]['role'] != 'system' %}{{ raise_exception('system first') }}{% endif %}", []),
        # harmony (gpt-oss): <|end|> closes every message, the analysis one mid-generation
        ("{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}",
         ["<|start|>", "<|message|>", "<|end|>", "<|return|>"]),
    ],
)
def test_no_turn_end(template: str | None, specials: list[str]) -> None:
    assert turn_end_token_ids(_gemma_format(template, specials)) == set()
