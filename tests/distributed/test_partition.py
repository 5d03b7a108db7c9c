"""How a model splits across tensor-parallel ranks: pure arithmetic, no processes."""
from __future__ import annotations

import pytest

from pagellm.config import EngineConfig
from pagellm.distributed.parallel_state import TPGroup
from pagellm.distributed.partition import (
    TPShard,
    allowed_tp_sizes,
    check_tp_size,
    max_kv_heads_per_rank,
    split_evenly,
)

SMOLLM2 = dict(num_heads=9, num_kv_heads=3, intermediate_size=1536, vocab=49152)


def test_split_evenly_gives_the_extra_to_the_first_pieces():
    assert split_evenly(3, 2) == [(0, 2), (2, 1)]
    assert split_evenly(1536, 2) == [(0, 768), (768, 768)]
    assert split_evenly(7, 3) == [(0, 3), (3, 2), (5, 2)]
    assert sum(n for _, n in split_evenly(49152, 5)) == 49152


def test_smollm2_over_two_ranks_splits_by_kv_head_groups():
    r0, r1 = (TPShard.of(r, 2, **SMOLLM2) for r in range(2))
    # rank 0: kv heads {0, 1} = q heads 0-5; rank 1: kv head {2} = q heads 6-8
    assert (r0.kv_head_start, r0.num_kv_heads, r0.q_head_start, r0.num_q_heads) == (0, 2, 0, 6)
    assert (r1.kv_head_start, r1.num_kv_heads, r1.q_head_start, r1.num_q_heads) == (2, 1, 6, 3)
    assert (r0.inter_start, r0.inter_size, r1.inter_start, r1.inter_size) == (0, 768, 768, 768)
    assert (r0.vocab_start, r0.vocab_size, r1.vocab_start, r1.vocab_size) == (0, 24576, 24576, 24576)
    assert max_kv_heads_per_rank(3, 2) == 2


def test_uneven_vocabulary_pads_the_last_rank():
    shards = [TPShard.of(r, 3, num_heads=9, num_kv_heads=3, intermediate_size=10, vocab=100) for r in range(3)]
    assert [s.vocab_padded for s in shards] == [34, 34, 34]
    assert [(s.vocab_start, s.vocab_size) for s in shards] == [(0, 34), (34, 34), (68, 32)]


def test_whole_model_is_one_shard():
    s = TPShard.whole(9, 3, 1536, 49152)
    assert (s.num_q_heads, s.num_kv_heads, s.inter_size, s.vocab_size) == (9, 3, 1536, 49152)


@pytest.mark.parametrize("tp", [4, 9])
def test_sizes_beyond_the_kv_heads_are_refused_with_the_allowed_ones(tp):
    with pytest.raises(ValueError, match=r"3 KV heads .*allowed sizes: 1, 2, 3"):
        check_tp_size(tp, 9, 3, 1536)
    assert allowed_tp_sizes(9, 3) == [1, 2, 3]
    check_tp_size(3, 9, 3, 1536)


def test_config_validates_the_distributed_flags():
    assert EngineConfig(device="cpu").distributed_executor_backend == "uni"
    assert EngineConfig(device="cpu", tensor_parallel_size=2).distributed_executor_backend == "mp"
    assert EngineConfig(device="cpu", tensor_parallel_size=2, distributed_executor_backend="ray").distributed_executor_backend == "ray"
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(device="cpu", tensor_parallel_size=0)
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        EngineConfig(device="cpu", tensor_parallel_size=2, distributed_executor_backend="mpi")


def test_cli_flags_reach_the_config():
    from pagellm.cli import build_parser, engine_kwargs

    args = build_parser().parse_args(["generate", "hi", "--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"])
    kwargs = engine_kwargs(args)
    assert kwargs["tensor_parallel_size"] == 2 and kwargs["distributed_executor_backend"] == "mp"


def test_a_single_rank_group_collectives_are_identities():
    import torch

    g = TPGroup()
    t = torch.ones(3)
    assert g.all_reduce(t) is t and g.broadcast(t) is t and g.all_gather(t) is t and g.is_first
