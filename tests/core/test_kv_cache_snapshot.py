"""The dashboard's snapshot of the KV cache: exact block states, diffs from dirty blocks only, privacy."""
from __future__ import annotations

import base64
import random

from sched_utils import FakeRunner, make_request, make_scheduler

from pagellm.core.block_pool import BlockPool
from pagellm.core.kv_cache_snapshot import CACHED, FREE, KVCacheSnapshotter, block_code


def step(sched, runner):
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out, sched.requests))


def codes_of(snap_full: dict) -> list[int]:
    return list(base64.b64decode(snap_full["codes"]))


def replay(full: dict, diffs: list[dict]) -> tuple[list[int], dict[str, list[int]]]:
    """What a dashboard client holds after a full snapshot and the diffs after it."""
    codes = codes_of(full)
    tables = {k: list(v) for k, v in full["tables"].items()}
    for d in diffs:
        for block_id, code in d.get("blocks", []):
            codes[block_id] = code
        for req_id, (start, *ids) in d.get("tables", {}).items():
            tables[req_id] = tables.get(req_id, [])[:start] + ids
        for req_id in d.get("tables_removed", []):
            tables.pop(req_id, None)
    return codes, tables


def test_block_pool_marks_changed_blocks_dirty():
    pool = BlockPool(6, enable_caching=True)
    assert pool.take_dirty_block_ids() == set()
    a = pool.get_new_blocks(2)
    assert pool.take_dirty_block_ids() == {0, 1}
    pool.cache_full_blocks(a, [b"h0", b"h1"], 0, 1)
    assert pool.take_dirty_block_ids() == {0}
    pool.touch([a[0]])
    pool.free_blocks(reversed(a))
    assert pool.take_dirty_block_ids() == {0, 1}
    assert pool.take_dirty_block_ids() == set()
    assert [block_code(b) for b in pool.blocks] == [2, FREE, FREE, FREE, FREE, FREE]
    pool.free_blocks([a[0]])
    assert block_code(pool.blocks[0]) == CACHED
    pool.reset_prefix_cache()
    assert pool.take_dirty_block_ids() == {0}
    assert block_code(pool.blocks[0]) == FREE


def test_shared_prefix_states_and_tables_are_exact():
    # block_size 4: a 9-token shared prefix is 2 full blocks; each request owns its third block.
    sched = make_scheduler(num_blocks=12, block_size=4, max_num_batched_tokens=64)
    snap = KVCacheSnapshotter(sched.kv_cache_manager, sched)
    assert snap.poll() is None  # nothing happened
    full0 = snap.full()
    assert codes_of(full0) == [FREE] * 12 and full0["counts"]["free"] == 12 and full0["v"] == 0
    prefix = list(range(1, 9))
    runner = FakeRunner(4)
    sched.add_request(make_request(sched, "a", prefix + [50], max_tokens=8))
    step(sched, runner)  # a computes the prefix, blocks 0 1 2
    sched.add_request(make_request(sched, "b", prefix + [60], max_tokens=8))
    sched.add_request(make_request(sched, "c", prefix + [70], max_tokens=8))
    step(sched, runner)  # b and c adopt blocks 0 and 1
    diff = snap.poll()
    assert diff["v"] == 1 and diff["type"] == "diff"
    assert diff["blocks"] == [[0, 4], [1, 4], [2, 2], [3, 2], [4, 2]]
    assert diff["tables"] == {"a": [0, 0, 1, 2], "b": [0, 0, 1, 3], "c": [0, 0, 1, 4]}
    assert [(r["id"], r["queue"], r["prompt"]) for r in diff["requests"]] == [
        ("a", "running", 9), ("b", "running", 9), ("c", "running", 9)
    ]
    assert diff["counts"] == {"free": 7, "cached": 0, "used": 3, "shared": 2, "engine_free": 7, "engine_used": 5}
    assert "text" not in diff["requests"][0]
    # Finishing releases: prefix blocks become cached, own blocks cached or free.
    while sched.has_unfinished_requests():
        step(sched, runner)
    diff = snap.poll()
    assert "tables" not in diff and sorted(diff["tables_removed"]) == ["a", "b", "c"]
    assert diff["requests"] == []
    full = snap.full()
    codes = codes_of(full)
    assert codes[0] == codes[1] == CACHED
    assert full["counts"]["used"] == full["counts"]["shared"] == 0
    assert full["counts"]["engine_used"] == 0
    assert full["tables"] == {}
    info = snap.describe_block(0)
    assert info["state"] == "cached" and info["owners"] == [] and len(info["hash"]) == 12


def test_diffs_replay_to_the_full_state_under_random_load():
    rng = random.Random(7)
    sched = make_scheduler(num_blocks=24, block_size=4, max_num_seqs=6, max_num_batched_tokens=24)
    snap = KVCacheSnapshotter(sched.kv_cache_manager, sched)
    runner = FakeRunner(4)
    full0 = snap.full()
    diffs = []
    prefixes = [[rng.randrange(1, 500) for _ in range(8)] for _ in range(3)]
    n = 0
    for _ in range(150):
        if rng.random() < 0.3 and n < 40:
            prompt = rng.choice(prefixes) + [rng.randrange(1, 500) for _ in range(rng.randrange(1, 12))]
            sched.add_request(make_request(sched, f"r{n}", prompt, max_tokens=rng.randrange(1, 20)))
            n += 1
        if sched.has_unfinished_requests():
            step(sched, runner)
        if rng.random() < 0.5:
            d = snap.poll()
            if d is not None:
                diffs.append(d)
                assert d["v"] == len(diffs)
    d = snap.poll()
    if d is not None:
        diffs.append(d)
    codes, tables = replay(full0, diffs)
    pool = sched.kv_cache_manager.block_pool
    assert codes == [block_code(b) for b in pool.blocks] == codes_of(snap.full())
    assert tables == {k: [b.block_id for b in v] for k, v in sched.kv_cache_manager.req_to_blocks.items()}
    assert sched.num_preemptions > 0  # the pool was tight enough to preempt
    counts = snap.full()["counts"]
    assert counts["used"] + counts["shared"] == counts["engine_used"]


def test_poll_reads_only_dirty_blocks():
    sched = make_scheduler(num_blocks=1000, block_size=4)
    snap = KVCacheSnapshotter(sched.kv_cache_manager, sched)
    pool = sched.kv_cache_manager.block_pool

    class Counting(list):
        reads = 0

        def __getitem__(self, i):
            Counting.reads += 1
            return list.__getitem__(self, i)

    pool.blocks = Counting(pool.blocks)
    sched.add_request(make_request(sched, "a", list(range(1, 10)), max_tokens=2))
    step(sched, FakeRunner(4))
    Counting.reads = 0
    diff = snap.poll()
    assert diff["blocks"] == [[0, 2], [1, 2], [2, 2]] and Counting.reads == 3
    Counting.reads = 0
    assert snap.poll() is None and Counting.reads == 0


def test_text_only_with_a_decoder():
    sched = make_scheduler(num_blocks=8, block_size=4)
    sched.add_request(make_request(sched, "a", [72, 105, 33, 33, 33], max_tokens=4))
    step(sched, FakeRunner(4))
    plain = KVCacheSnapshotter(sched.kv_cache_manager, sched).poll()
    assert "text" not in repr(plain) and "72" not in repr(plain["requests"])
    snap = KVCacheSnapshotter(sched.kv_cache_manager, sched, decode=lambda ids: "".join(map(chr, ids)))
    diff = snap.poll()
    assert diff["requests"][0]["text"] == "Hi!!!"
    info = snap.describe_block(0)
    assert info["text"] == "Hi!!" and info["owners"] == [{"id": "a", "index": 0}] and info["num_written"] == 4
    assert "text" not in KVCacheSnapshotter(sched.kv_cache_manager, sched).describe_block(0)
