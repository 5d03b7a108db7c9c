"""Content hashes of full KV blocks, chained so that a block's hash covers its whole prefix.

Two blocks share a hash only if they hold the same tokens *and* everything before them is the
same, which is exactly when their keys and values are equal. SHA-256 makes an accidental match
(which would hand a request someone else's KV) practically impossible, unlike Python's
64-bit ``hash``. Anything else that changes the KV, such as a tenant's ``cache_salt`` or a LoRA adapter, is mixed
into the first block so one tenant's prefix can never be found by another.
"""
from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Callable, Optional

import numpy as np

if TYPE_CHECKING:
    from pagellm.request import Request

BlockHash = bytes

# Roots every chain; changing it invalidates nothing persistent since the cache lives in memory.
_ROOT = hashlib.sha256(b"pagellm-prefix-cache-v1").digest()


def hash_block_tokens(parent_hash: Optional[BlockHash], token_ids: list[int], extra_key: Optional[str] = None) -> BlockHash:
    h = hashlib.sha256(parent_hash if parent_hash is not None else _ROOT)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    if extra_key is not None:
        h.update(b"\x00salt\x00" + extra_key.encode("utf-8", "surrogatepass"))
    return h.digest()


def hash_full_blocks(
    token_ids: list[int],
    block_size: int,
    cache_salt: Optional[str] = None,
    start: int = 0,
    parent: Optional[BlockHash] = None,
) -> list[BlockHash]:
    """Chained hashes of the full blocks of ``token_ids`` from block ``start`` on, ``parent``
    being block ``start - 1``'s hash (None from the first block)."""
    hashes: list[BlockHash] = []
    for i in range(start, len(token_ids) // block_size):
        parent = hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size], cache_salt if i == 0 else None)
        hashes.append(parent)
    return hashes


def make_block_hasher(block_size: int) -> Callable[["Request"], list[BlockHash]]:
    """Returns a function giving the hashes of a request's full blocks not hashed yet."""

    def hasher(request: "Request") -> list[BlockHash]:
        start = len(request.block_hashes)
        parent = request.block_hashes[-1] if start else None
        return hash_full_blocks(request.all_token_ids, block_size, request.prefix_cache_key, start, parent)

    return hasher


# Separates a content hash from the group id appended to it (SHA-256 digests are 32 bytes).
_GROUP_TAG = b"\x00group"


def group_block_hash(block_hash: BlockHash, group_id: int) -> BlockHash:
    """The prefix-cache key of a token block's page in one KV cache group.

    Every group's page for the same tokens has the same content hash but holds other layers, so
    the pool indexes each under its own key; group 0 keeps the bare hash, as a one-group cache did.
    """
    if group_id == 0:
        return block_hash
    return block_hash + _GROUP_TAG + group_id.to_bytes(4, "big")


def group_of_block_hash(key: BlockHash) -> int:
    """The group a prefix-cache key was made for (``group_block_hash``'s inverse on the group)."""
    if len(key) >= len(_GROUP_TAG) + 4 and key[-len(_GROUP_TAG) - 4 : -4] == _GROUP_TAG:
        return int.from_bytes(key[-4:], "big")
    return 0

