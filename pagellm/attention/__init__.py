"""Attention over the paged KV cache: the backend interface, the backends and their selector.

Importing this package compiles nothing; the C++ kernel is built (or loaded from the cache) the
first time a "cpu_paged" backend is asked for.
"""
from pagellm.attention.backend import AttentionBackend, AttentionMetadata, AttentionOptions
from pagellm.attention.kv_quant import write_kv_cache
from pagellm.attention.selector import BACKEND_NAMES, get_attn_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "AttentionOptions", "BACKEND_NAMES", "get_attn_backend", "write_kv_cache"]
