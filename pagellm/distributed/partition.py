"""How a Llama-family model's dimensions split across tensor-parallel ranks (pure arithmetic).

Attention splits by KV-head groups: rank ``r`` holds a contiguous run of KV heads and the query
heads that read them. When the KV heads do not divide evenly the earlier ranks take one more
(SmolLM2-135M's 3 KV heads over 2 ranks: rank 0 holds KV heads 0-1 = query heads 0-5, rank 1
KV head 2 = query heads 6-8). A rank with no KV head would have to replicate one; that is not
supported, so the tensor-parallel size may be at most the number of KV heads.
"""
from __future__ import annotations

from dataclasses import dataclass


def split_evenly(total: int, parts: int) -> list[tuple[int, int]]:
    """``(start, size)`` of each of ``parts`` contiguous pieces of ``total``; the first ones larger by one."""
    base, extra = divmod(total, parts)
    pieces, start = [], 0
    for i in range(parts):
        size = base + (i < extra)
        pieces.append((start, size))
        start += size
    return pieces


def allowed_tp_sizes(num_heads: int, num_kv_heads: int) -> list[int]:
    return list(range(1, num_kv_heads + 1)) if num_heads % num_kv_heads == 0 else [1]


def check_tp_size(tp_size: int, num_heads: int, num_kv_heads: int, intermediate_size: int) -> None:
    """ValueError naming the sizes that work when ``tp_size`` cannot split this model."""
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp_size!r}")
    if tp_size == 1:
        return
    allowed = allowed_tp_sizes(num_heads, num_kv_heads)
    if tp_size not in allowed or tp_size > intermediate_size:
        raise ValueError(
            f"tensor_parallel_size={tp_size} cannot split this model: it has {num_kv_heads} KV heads "
            f"({num_heads} query heads) and every rank needs at least one whole KV head with its query heads "
            f"(KV-head replication is not supported); allowed sizes: {', '.join(map(str, allowed))}"
        )


@dataclass(frozen=True)
class TPShard:
    """One rank's slice of every split dimension, in heads / rows of the full checkpoint."""

    rank: int
    world_size: int
    q_head_start: int
    num_q_heads: int
    kv_head_start: int
    num_kv_heads: int
    inter_start: int
    inter_size: int
    vocab_start: int
    vocab_size: int  # real rows this rank holds (the last rank's may be fewer than vocab_padded)
    vocab_padded: int  # rows every rank allocates, so the logits' all-gather has equal pieces

    @classmethod
    def of(cls, rank: int, world_size: int, num_heads: int, num_kv_heads: int, intermediate_size: int, vocab: int) -> "TPShard":
        check_tp_size(world_size, num_heads, num_kv_heads, intermediate_size)
        group = num_heads // num_kv_heads
        kv_start, kv_n = split_evenly(num_kv_heads, world_size)[rank]
        inter_start, inter_n = split_evenly(intermediate_size, world_size)[rank]
        padded = -(-vocab // world_size)
        vocab_start = rank * padded
        return cls(
            rank,
            world_size,
            kv_start * group,
            kv_n * group,
            kv_start,
            kv_n,
            inter_start,
            inter_n,
            vocab_start,
            max(0, min(padded, vocab - vocab_start)),
            padded,
        )

    @classmethod
    def whole(cls, num_heads: int, num_kv_heads: int, intermediate_size: int, vocab: int) -> "TPShard":
        return cls.of(0, 1, num_heads, num_kv_heads, intermediate_size, vocab)


def max_kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """The most KV heads any rank holds: what sizes every rank's KV cache (same block ids everywhere)."""
    return max(n for _, n in split_evenly(num_kv_heads, tp_size))
