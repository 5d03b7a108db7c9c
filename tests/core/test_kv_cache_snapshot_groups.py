"""The dashboard's snapshot over KV cache groups: diffs still replay to the engine's tables while a
window nulls entries, counts leave the null block out, and a block's owners are found in any group."""
from __future__ import annotations

import random

from kv_groups_utils import WindowCheckingRunner, make_grouped_scheduler, make_request
from test_kv_cache_snapshot import codes_of, replay

from pagellm.core.kv_cache_snapshot import KVCacheSnapshotter, block_code


def run(layer_windows, seed: int):
    rng = random.Random(seed)
    sched = make_grouped_scheduler(
        layer_windows, num_blocks=40, block_size=4, max_num_seqs=4, max_num_batched_tokens=12, enable_caching=True
    )
    snap = KVCacheSnapshotter(sched.kv_cache_manager, sched)
    runner = WindowCheckingRunner.for_scheduler(sched)
    full0, diffs = snap.full(), []
    for n in range(120):
        if rng.random() < 0.3:
            prompt = [rng.randrange(1, 50) for _ in range(rng.randrange(1, 20))]
            sched.add_request(make_request(sched, f"r{n}", prompt, max_tokens=rng.randrange(1, 24)))
        if sched.has_unfinished_requests():
            out = sched.schedule()
            sched.update_from_output(out, runner.execute(out))
        if rng.random() < 0.5 and (d := snap.poll()) is not None:
            diffs.append(d)
    if (d := snap.poll()) is not None:
        diffs.append(d)
    return sched, snap, full0, diffs


def test_diffs_replay_while_a_window_nulls_entries():
    sched, snap, full0, diffs = run([8, 8], seed=3)  # one sliding group: its tables are shown
    kv = sched.kv_cache_manager
    codes, tables = replay(full0, diffs)
    assert codes == [block_code(b) for b in kv.block_pool.blocks] == codes_of(snap.full())
    assert tables == {k: [b.block_id for b in v] for k, v in kv.req_to_blocks.items()}
    assert any(0 in t for t in tables.values())  # some entries are the null block
    counts = snap.full()["counts"]
    assert counts["used"] + counts["shared"] == counts["engine_used"] == kv.block_pool.num_used_blocks


def replay_groups(full: dict, diffs: list[dict]) -> dict[str, dict[str, list[int]]]:
    """The other groups' tables a dashboard client holds after a full snapshot and the diffs after it."""
    groups = {g: {k: list(v) for k, v in t.items()} for g, t in full.get("group_tables", {}).items()}
    for d in diffs:
        for g, changed in d.get("group_tables", {}).items():
            tables = groups.setdefault(g, {})
            for req_id, (start, *ids) in changed.items():
                tables[req_id] = tables.get(req_id, [])[:start] + ids
        for g, removed in d.get("group_tables_removed", {}).items():
            for req_id in removed:
                groups.get(g, {}).pop(req_id, None)
    return groups


def test_two_groups_show_every_group_and_find_owners_in_both():
    sched, snap, full0, diffs = run([None, 8], seed=5)
    kv = sched.kv_cache_manager
    _, tables = replay(full0, diffs)
    assert tables == {k: [b.block_id for b in v] for k, v in kv.req_to_blocks.items()}
    want = {k: [b.block_id for b in v] for k, v in kv.group_tables[1].items()}
    assert want and replay_groups(full0, diffs)["1"] == want == snap.full()["group_tables"]["1"]
    assert any(0 in t for t in want.values())  # the sliding group's entries behind its window are null
    assert snap.full()["groups"] == [{"window": None, "layers": [0]}, {"window": 8, "layers": [1]}]
    assert any("group_tables_removed" in d for d in diffs)  # finished requests leave the other group too
    req_id, blocks = next((k, v) for k, v in kv.group_tables[1].items() if v and v[-1] is not kv.block_pool.null_block)
    info = snap.describe_block(blocks[-1].block_id)
    assert {"id": req_id, "index": len(blocks) - 1, "group": 1} in info["owners"]
    assert snap.describe_block(0)["owners"] == []  # the null block belongs to no one
