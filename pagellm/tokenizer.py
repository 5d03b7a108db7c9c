"""Loading the tokenizer of a Hugging Face directory or a GGUF file, offline.

For GGUF we go through ``PreTrainedTokenizerFast.from_pretrained(gguf_file=...)`` directly:
``AutoTokenizer`` would first rebuild the whole model config with ``gguf.GGUFReader`` (seconds on
a 49k vocabulary) just to pick the tokenizer class, while the tokenizer it builds is the same.
Only Hugging Face directories import it here: its registry of every model's classes takes half a
second, and for GGUF the conversion imports that registry itself, on the tokenizer's thread
beside the weights' packing rather than on the engine's thread before loading begins.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from pagellm.models.loader import is_gguf, resolve_model_path


def load_tokenizer(model_path: str) -> PreTrainedTokenizerBase:
    """The model's tokenizer with its special tokens and chat template; never touches the network."""
    path = resolve_model_path(model_path)
    if is_gguf(path):
        tokenizer = PreTrainedTokenizerFast.from_pretrained(
            os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path), local_files_only=True
        )
    else:
        from transformers import AutoTokenizer  # its registry of every model's classes: HF directories only

        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return tokenizer


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
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
    tokenizer: PreTrainedTokenizerBase,
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
