"""The dashboard's snapshot of a hybrid model's recurrent state slots, without a model: exact slot
ids and states (live, checkpoint, being saved, free) and owners, diffs from the slot pool's own
dirty ids replayed to the pool, and nothing of it for a model without recurrent layers."""
from __future__ import annotations

import base64
import random

from sched_utils import FakeRunner, make_hybrid_scheduler, make_request, make_scheduler, step

from pagellm.core.kv_cache_snapshot import (
    SLOT_CHECKPOINT,
    SLOT_FREE,
    SLOT_LIVE,
    SLOT_SAVING,
    KVCacheSnapshotter,
    slot_code,
)
from pagellm.core.scheduler import Scheduler

BLOCK = 4
SLOT_BYTES = 3 << 20
F, C, L, S = SLOT_FREE, SLOT_CHECKPOINT, SLOT_LIVE, SLOT_SAVING
SMALL = dict(num_blocks=32, num_slots=8, max_num_batched_tokens=64)


def snapshotter(sched: Scheduler) -> KVCacheSnapshotter:
    n = sched.kv_cache_manager.state_cache.num_slots
    return KVCacheSnapshotter(sched.kv_cache_manager, sched, cache_info={"state_bytes": n * SLOT_BYTES, "state_slots": n})


def slot_codes(full: dict) -> list[int]:
    return list(base64.b64decode(full["state"]["codes"]))


def replay_state(full: dict, diffs: list[dict]) -> tuple[list[int], dict[str, int]]:
    """The slot codes and owners a dashboard client holds after a full snapshot and the diffs after it."""
    codes, owners = slot_codes(full), dict(full["state"]["owners"])
    for d in diffs:
        state = d.get("state", {})
        for slot_id, code in state.get("slots", []):
            codes[slot_id] = code
        owners.update(state.get("owners", {}))
        for req_id in state.get("owners_removed", []):
            del owners[req_id]
    return codes, owners


def test_live_slots_checkpoints_and_resumes_are_exact():
    sched, runner = make_hybrid_scheduler(**SMALL), FakeRunner(BLOCK)
    snap = snapshotter(sched)
    assert snap.poll() is None
    full = snap.full()
    assert slot_codes(full) == [F] * 8 and full["state"]["owners"] == {} and full["state"]["checkpoint_interval"] == 8
    prompt = list(range(1, 22))  # 21 tokens: checkpoints at 8 and 16 (interval), 20 (the last full block)
    sched.add_request(make_request(sched, "a", prompt, max_tokens=3))
    out = sched.schedule()
    # Between scheduling and the step's end the checkpoints are being written: held, no one's live slot.
    state = snap.poll()["state"]
    assert state["slots"] == [[0, L], [1, S], [2, S], [3, S]] and state["owners"] == {"a": 0}
    assert out.state_steps["a"].checkpoints == ((8, 1), (16, 2), (20, 3))
    sched.update_from_output(out, runner.execute(out, sched.requests))
    state = snap.poll()["state"]
    assert state["slots"] == [[1, C], [2, C], [3, C]] and "owners" not in state
    assert state["counts"] == {
        "free": 4, "checkpoint": 3, "live": 1, "saving": 0, "engine_live": 1, "engine_checkpoints": 3, "engine_free": 7,
        "written": 3, "restored": 0, "slot_bytes": SLOT_BYTES, "checkpoint_bytes": 3 * SLOT_BYTES,
    }
    # b shares 17 tokens: it resumes from the checkpoint at 16 (slot 2) into a live slot of its own.
    sched.add_request(make_request(sched, "b", prompt[:17] + [90], max_tokens=2))
    out = sched.schedule()
    assert out.state_steps["b"].slot == 4 and out.state_steps["b"].restore_from == 2
    resumed = snap.poll()["state"]
    assert resumed["slots"] == [[4, L]] and resumed["owners"] == {"b": 4}  # slot 2, held while copied, stays a checkpoint
    # The engine counts only free checkpoints: the held one is out of it (and of the free queue) meanwhile.
    want = {**state["counts"], "live": 2, "free": 3, "engine_live": 2, "engine_checkpoints": 2, "engine_free": 5, "restored": 1}
    assert resumed["counts"] == want
    sched.update_from_output(out, runner.execute(out, sched.requests))
    d = snap.poll()
    assert d["state"] == {"counts": {**want, "engine_checkpoints": 3, "engine_free": 6}}  # slot 2 is free again
    full = snap.full()
    assert slot_codes(full) == [L, C, C, C, L, F, F, F] and full["state"]["owners"] == {"a": 0, "b": 4}
    assert snap.describe_slot(4) == {"id": 4, "state": "live", "ref_cnt": 1, "owner": "b", "hash": None, "kv_block": None}
    cp = snap.describe_slot(2)
    assert cp["state"] == "checkpoint" and cp["owner"] is None and len(cp["hash"]) == 12
    assert cp["kv_block"] == 3  # the KV block ending at token 16, where the state was saved
    assert snap.describe_block(3)["hash"] == cp["hash"]
    while sched.has_unfinished_requests():
        step(sched, runner)
    state = snap.poll()["state"]
    assert state["slots"] == [[0, F], [4, F]] and sorted(state["owners_removed"]) == ["a", "b"]
    assert (state["counts"]["live"], state["counts"]["checkpoint"], state["counts"]["written"], state["counts"]["restored"]) == (0, 3, 3, 1)
    assert snap.full()["state"]["owners"] == {}


def test_the_engine_counters_alone_make_a_diff():
    sched, runner = make_hybrid_scheduler(**SMALL), FakeRunner(BLOCK)
    prompt = list(range(1, 10))  # 9 tokens: a checkpoint at 8
    sched.add_request(make_request(sched, "a", prompt, max_tokens=1))
    while sched.has_unfinished_requests():
        step(sched, runner)
    snap = snapshotter(sched)
    sched.add_request(make_request(sched, "b", prompt, max_tokens=1))
    while sched.has_unfinished_requests():
        step(sched, runner)
    # Between two polls b took slot 0 and gave it back, and slot 1's checkpoint was held for its
    # restore and released: no slot looks different and no owner is left, but a state was resumed.
    assert snap.poll()["state"] == {"counts": {
        "free": 7, "checkpoint": 1, "live": 0, "saving": 0, "engine_live": 0, "engine_checkpoints": 1, "engine_free": 8,
        "written": 1, "restored": 1, "slot_bytes": SLOT_BYTES, "checkpoint_bytes": SLOT_BYTES,
    }}
    assert snap.poll() is None


def assert_replays_to_the_pool(sched: Scheduler, snap: KVCacheSnapshotter, full0: dict, diffs: list[dict]) -> None:
    state = sched.kv_cache_manager.state_cache
    live = {req_id: slot.block_id for req_id, slot in state.live.items()}
    codes, owners = replay_state(full0, diffs)
    assert codes == [slot_code(b, b.block_id in live.values()) for b in state.pool.blocks] == slot_codes(snap.full())
    assert owners == live == snap.full()["state"]["owners"]
    counts = snap.full()["state"]["counts"]
    assert counts["live"] == counts["engine_live"] and counts["checkpoint"] == counts["engine_checkpoints"]
    assert counts["free"] + counts["checkpoint"] == counts["engine_free"] and counts["saving"] == 0  # between steps


def test_diffs_replay_to_the_slot_pool_under_random_load():
    rng = random.Random(11)
    # 18 blocks of 4 tokens for up to 6 requests of up to 45 tokens: preemptions free live slots too.
    sched, runner = make_hybrid_scheduler(num_blocks=18, num_slots=6, max_num_seqs=6, max_num_batched_tokens=24), FakeRunner(BLOCK)
    snap = snapshotter(sched)
    full0, diffs, num_live_checked = snap.full(), [], 0
    stems = [[rng.randrange(1, 50) for _ in range(rng.randrange(8, 30))] for _ in range(3)]
    for n in range(200):
        if rng.random() < 0.35 and n < 150:
            stem = rng.choice(stems)
            prompt = stem[: rng.randrange(1, len(stem) + 1)] + [rng.randrange(50, 99) for _ in range(rng.randrange(1, 6))]
            sched.add_request(make_request(sched, f"r{n}", prompt, max_tokens=rng.randrange(1, 12)))
        if sched.has_unfinished_requests():
            step(sched, runner)
        if rng.random() < 0.5 and (d := snap.poll()) is not None:
            diffs.append(d)
            if rng.random() < 0.2:
                assert_replays_to_the_pool(sched, snap, full0, diffs)
                num_live_checked += bool(sched.kv_cache_manager.state_cache.live)
    if (d := snap.poll()) is not None:
        diffs.append(d)
    assert_replays_to_the_pool(sched, snap, full0, diffs)
    counts = snap.full()["state"]["counts"]
    assert counts["restored"] > 0 and counts["written"] > counts["checkpoint"]  # checkpoints were resumed and evicted
    assert sched.num_preemptions > 0 and num_live_checked > 0


def test_poll_reads_only_dirty_slots():
    sched = make_hybrid_scheduler(num_blocks=32, num_slots=500, max_num_batched_tokens=64)
    snap = snapshotter(sched)
    pool = sched.kv_cache_manager.state_cache.pool

    class Counting(list):
        reads = 0

        def __getitem__(self, i):
            Counting.reads += 1
            return list.__getitem__(self, i)

    pool.blocks = Counting(pool.blocks)
    sched.add_request(make_request(sched, "a", list(range(1, 10)), max_tokens=2))
    step(sched, FakeRunner(BLOCK))
    Counting.reads = 0
    assert snap.poll()["state"]["slots"] == [[0, L], [1, C]] and Counting.reads == 2
    Counting.reads = 0
    assert snap.poll() is None and Counting.reads == 0


def test_a_model_without_recurrent_layers_has_no_state():
    sched = make_scheduler(num_blocks=8, block_size=BLOCK)
    snap = KVCacheSnapshotter(sched.kv_cache_manager, sched)
    sched.add_request(make_request(sched, "a", list(range(1, 10)), max_tokens=2))
    step(sched, FakeRunner(BLOCK))
    assert "state" not in snap.poll() and "state" not in snap.full()
