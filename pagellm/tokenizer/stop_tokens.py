"""The stop token a chat template implies: the special token that closes an assistant's turn.

A Hugging Face directory lists every stop token in generation_config.json (Gemma 3's
``[<eos>, <end_of_turn>]``, Llama 3's ``<|eot_id|>``). A GGUF file names only its EOS (and at most an
EOT / EOM id, which llama.cpp's converter seldom writes); llama.cpp's server then stops on tokens it
recognises by their text (``<end_of_turn>``, Gemma 4's ``<turn|>``, ...). Here the file's own chat
template says it: the special token written right after an assistant message's content.
"""
from __future__ import annotations

from typing import Any

from jinja2 import TemplateError

from pagellm.tokenizer.loader import render_chat

_PROBE = "pagellm-turn-end-probe"
# The harmony format (gpt-oss) ends every message with <|end|>, the analysis one mid-generation; its
# stops are <|return|> and <|call|>. llama.cpp drops <|end|> from its stops for such a vocabulary too.
_HARMONY_MESSAGE_END, _HARMONY_RETURN = "<|end|>", "<|return|>"


def turn_end_token_ids(tokenizer: Any) -> set[int]:
    """``{id}`` of the special token that ends an assistant turn in ``tokenizer``'s chat template, or
    an empty set: no template, one that does not render a user / assistant exchange, or plain text
    after the assistant's content."""
    if not getattr(tokenizer, "chat_template", None):
        return set()
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _PROBE}]
    try:
        text = render_chat(tokenizer, conversation, add_generation_prompt=False)
    except (TemplateError, ValueError, TypeError, KeyError):
        return set()  # a template that wants other roles or arguments: no stop token learned from it
    at = text.find(_PROBE)
    if at < 0:
        return set()
    ids = tokenizer.encode(text[at + len(_PROBE):].lstrip(" "), add_special_tokens=False)
    if not ids:
        return set()
    first = ids[0]
    # Special: it vanishes when special tokens are skipped (a control token of a GGUF vocabulary too).
    if tokenizer.decode([first], skip_special_tokens=True) or not tokenizer.decode([first]):
        return set()
    if tokenizer.decode([first]) == _HARMONY_MESSAGE_END and _HARMONY_RETURN in tokenizer.get_vocab():
        return set()
    return {first}
