"""Tokenizers, offline: loading a model's (``loader``), the Hugging Face tokenizer API over a
``tokenizers`` backend without importing transformers (``fast``), and chat templates rendered as
transformers renders them (``chat_template``), and the stop token a chat template implies
(``stop_tokens``)."""
from pagellm.tokenizer.loader import (
    BYTE_LEVEL_SPLITS,
    GPT2_SPLIT_TYPES,
    apply_chat_template,
    byte_level_gguf_tokenizer,
    bytes_to_unicode,
    load_tokenizer,
    render_chat,
)
from pagellm.tokenizer.stop_tokens import turn_end_token_ids

__all__ = [
    "BYTE_LEVEL_SPLITS",
    "GPT2_SPLIT_TYPES",
    "apply_chat_template",
    "byte_level_gguf_tokenizer",
    "bytes_to_unicode",
    "load_tokenizer",
    "render_chat",
    "turn_end_token_ids",
]
