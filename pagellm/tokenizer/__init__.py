"""Tokenizers, offline: loading a model's (``loader``), the Hugging Face tokenizer API over a
``tokenizers`` backend without importing transformers (``fast``), and chat templates rendered as
transformers renders them (``chat_template``)."""
from pagellm.tokenizer.loader import (
    BYTE_LEVEL_SPLITS,
    GPT2_SPLIT_TYPES,
    apply_chat_template,
    byte_level_gguf_tokenizer,
    bytes_to_unicode,
    load_tokenizer,
    render_chat,
)

__all__ = [
    "BYTE_LEVEL_SPLITS",
    "GPT2_SPLIT_TYPES",
    "apply_chat_template",
    "byte_level_gguf_tokenizer",
    "bytes_to_unicode",
    "load_tokenizer",
    "render_chat",
]
