import pytest

from pagellm.core.block_hash import hash_block_tokens, make_block_hasher
from pagellm.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from pagellm.request import Request
from pagellm.sampling_params import SamplingParams


def test_free_queue_popleft_remove_append_are_ordered():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    assert q.block_ids() == [0, 1, 2, 3, 4]
    assert q.popleft().block_id == 0
    q.remove(blocks[2])
    assert q.block_ids() == [1, 3, 4]
    q.append(blocks[0])
    q.append(blocks[2])
    assert q.block_ids() == [1, 3, 4, 0, 2]
    assert q.num_free_blocks == 5
    with pytest.raises(RuntimeError):
        q.remove(KVCacheBlock(9))


def test_free_queue_empty_raises():
    q = FreeKVCacheBlockQueue([KVCacheBlock(0)])
    q.popleft()
    with pytest.raises(ValueError):
        q.popleft()


def test_get_new_blocks_and_free_reference_counts():
    pool = BlockPool(4, enable_caching=True)
    a = pool.get_new_blocks(2)
    assert [b.block_id for b in a] == [0, 1]
    assert [b.ref_cnt for b in a] == [1, 1]
    assert pool.num_free_blocks == 2
    pool.touch(a)  # a second owner
    assert [b.ref_cnt for b in a] == [2, 2]
    pool.free_blocks(a)
    assert pool.num_free_blocks == 2
    pool.free_blocks(reversed(a))
    assert pool.num_free_blocks == 4
    # Freed tail-first, after the never-used blocks.
    assert pool.free_queue.block_ids() == [2, 3, 1, 0]
    with pytest.raises(RuntimeError):
        pool.free_blocks([a[0]])
    pool.check_integrity()


def test_cached_free_blocks_are_revived_and_evicted_lru():
    pool = BlockPool(3, enable_caching=True)
    h = [hash_block_tokens(None, [1, 2])]
    h.append(hash_block_tokens(h[0], [3, 4]))
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, h, 0, 2)
    pool.free_blocks(reversed(blocks))
    assert pool.num_free_blocks == 3
    assert pool.num_cached_free_blocks == 2
    # Still findable after being freed.
    assert pool.get_cached_block(h[0]) is blocks[0]
    pool.touch([blocks[0]])
    assert blocks[0].ref_cnt == 1 and pool.num_free_blocks == 2
    pool.free_blocks([blocks[0]])
    # Eviction order: the never-cached block 2, then the chain's tail (1), then its head (0).
    assert pool.free_queue.block_ids() == [2, 1, 0]
    new = pool.get_new_blocks(2)
    assert [b.block_id for b in new] == [2, 1]
    assert pool.get_cached_block(h[1]) is None  # evicted
    assert pool.get_cached_block(h[0]) is blocks[0]
    assert blocks[1].block_hash is None
    pool.check_integrity()


def test_duplicate_computation_keeps_first_block_indexed():
    pool = BlockPool(2, enable_caching=True)
    h = [hash_block_tokens(None, [7])]
    first, second = pool.get_new_blocks(1), pool.get_new_blocks(1)
    pool.cache_full_blocks(first, h, 0, 1)
    pool.cache_full_blocks(second, h, 0, 1)
    assert pool.get_cached_block(h[0]) is first[0]
    pool.free_blocks(second)
    assert second[0].block_hash is None  # nobody can find it, so it is a plain free block
    pool.check_integrity()


def test_caching_disabled_finds_nothing():
    pool = BlockPool(2, enable_caching=False)
    h = [hash_block_tokens(None, [1])]
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(blocks, h, 0, 1)
    assert pool.get_cached_block(h[0]) is None


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(2, enable_caching=True)
    h = [hash_block_tokens(None, [1])]
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(blocks, h, 0, 1)
    assert not pool.reset_prefix_cache()
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(h[0]) is None


def test_block_hashes_chain_and_salt():
    hasher = make_block_hasher(4)
    r1 = Request("a", list(range(10)), SamplingParams(), 5, block_hasher=hasher)
    r2 = Request("b", list(range(8)) + [99, 98], SamplingParams(), 5, block_hasher=hasher)
    r3 = Request("c", list(range(10)), SamplingParams(), 5, cache_salt="tenant", block_hasher=hasher)
    assert len(r1.block_hashes) == 2  # only full blocks
    assert r1.block_hashes == r2.block_hashes
    assert r3.block_hashes[0] != r1.block_hashes[0] and r3.block_hashes[1] != r1.block_hashes[1]
    r1.append_output_token_ids([10, 11])
    assert len(r1.block_hashes) == 3
    # The same tokens behind a different prefix hash differently.
    r4 = Request("d", [5, 5, 5, 5] + list(range(4, 8)), SamplingParams(), 5, block_hasher=hasher)
    assert r4.block_hashes[1] != r1.block_hashes[1]
