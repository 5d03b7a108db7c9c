"""The offloader: pages saved and loaded byte for byte across every KV tensor, loads that stop at the
first bad key, pages served from staging, bounded staging (dropped saves, resident memory)."""
from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path
from typing import Optional

import pytest
import torch

from pagellm.kv_offload import DiskKVStore, HostKVStore, KVOffloader, KVStore
from pagellm.kv_offload.store import header_size

IDENTITY = {"model": "test", "v": 1}
NUM_BLOCKS = 12


def key(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def make_tensors(dtypes: list[torch.dtype], seed: int = 0) -> list[torch.Tensor]:
    """KV cache tensors [2, num_blocks, block_size, heads, row_width], different shapes per tensor."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, dt in enumerate(dtypes):
        shape = (2, NUM_BLOCKS, 4, 2 + i, 8 + 4 * i)
        if dt.is_floating_point:
            out.append(torch.randn(shape, generator=g).to(dt))
        else:
            out.append(torch.randint(-128, 128, shape, generator=g, dtype=torch.int16).to(dt))
    return out


def page(tensors: list[torch.Tensor], block_id: int) -> bytes:
    return b"".join(t[:, block_id].contiguous().view(torch.uint8).cpu().numpy().tobytes() for t in tensors)


def snapshot(tensors: list[torch.Tensor]) -> list[bytes]:
    return [page(tensors, b) for b in range(NUM_BLOCKS)]


def store_of(kind: str, tmp_path: Path) -> KVStore:
    return HostKVStore(10**9) if kind == "host" else DiskKVStore(str(tmp_path / "tier"), IDENTITY, 10**9, fsync=False)


class GatedStore(HostKVStore):
    """A host store whose writes wait for ``gate``, and which records the order of its calls."""

    def __init__(self) -> None:
        super().__init__(10**9)
        self.gate = threading.Event()
        self.entered = threading.Event()  # a write is waiting at the gate
        self.calls: list[tuple[str, bytes]] = []

    def write(self, key: bytes, payload) -> bool:
        self.entered.set()
        self.gate.wait(timeout=30)
        self.calls.append(("write", key))
        return super().write(key, payload)

    def read(self, key: bytes) -> Optional[bytes]:
        self.calls.append(("read", key))
        return super().read(key)


@pytest.mark.parametrize("kind", ["host", "disk"])
@pytest.mark.parametrize(
    "dtypes",
    [[torch.float16], [torch.bfloat16], [torch.int8], [torch.bfloat16, torch.int8, torch.float32]],
    ids=["f16", "bf16", "i8", "mixed"],
)
def test_save_then_load_into_other_blocks_is_bytes_equal(tmp_path, kind, dtypes):
    tensors = make_tensors(dtypes)
    off = KVOffloader(tensors, store_of(kind, tmp_path))
    assert off.page_bytes == len(page(tensors, 0))
    before = snapshot(tensors)
    off.save([(1, key(1)), (3, key(3)), (5, key(5))])
    off.drain()
    assert off.store.keys() == [key(1), key(3), key(5)]
    assert off.store.read(key(3)) == before[3]
    off.load("r", [(8, key(1)), (9, key(3)), (10, key(5))])
    off.wait(10)
    rep = off.poll()
    assert rep.loaded == {"r": 3} and rep.removed == []
    after = snapshot(tensors)
    assert after[8:11] == [before[1], before[3], before[5]]
    assert after[:8] + after[11:] == before[:8] + before[11:]  # no other block touched
    for t in tensors:
        assert torch.equal(t[:, 9].view(torch.uint8), t[:, 3].view(torch.uint8))
    st = off.stats
    assert (st.num_saves, st.num_loads, st.num_pages_loaded, st.num_pages_failed, st.num_writes) == (3, 1, 3, 0, 3)
    assert st.load_seconds > 0 and st.staged_bytes == 0 and st.staged_bytes_peak == 3 * off.page_bytes
    off.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_round_trip_through_pinned_staging(tmp_path):
    tensors = [t.cuda() for t in make_tensors([torch.bfloat16, torch.int8])]
    off = KVOffloader(tensors, store_of("disk", tmp_path))
    before = snapshot(tensors)
    off.save([(1, key(1)), (2, key(2))])
    tensors[0][:, 1:3] = 0  # copied out already
    off.load("staged", [(5, key(1))])  # from staging or the store, whichever is first
    off.drain()
    off.load("stored", [(6, key(1)), (7, key(2))])
    off.wait(10)
    off.drain()
    assert off.poll().loaded == {"staged": 1, "stored": 2}
    assert snapshot(tensors)[5:8] == [before[1], before[1], before[2]]
    assert off._staging.is_pinned()
    off.close()


def test_save_copies_the_page_at_once(tmp_path):
    tensors = make_tensors([torch.bfloat16])
    store = GatedStore()
    off = KVOffloader(tensors, store)
    want = page(tensors, 2)
    off.save([(2, key(2))])
    tensors[0][:, 2] = 0  # the step's forward pass overwrites the block right after
    store.gate.set()
    off.drain()
    assert store.read(key(2)) == want


def test_load_of_a_damaged_second_key_loads_one_of_three(tmp_path):
    tensors = make_tensors([torch.float16, torch.int8])
    store = DiskKVStore(str(tmp_path / "tier"), IDENTITY, 10**9, fsync=False)
    off = KVOffloader(tensors, store)
    before = snapshot(tensors)
    off.save([(0, key(0)), (1, key(1)), (2, key(2))])
    off.drain()
    path = store.path_of(key(1))
    data = bytearray(Path(path).read_bytes())
    data[header_size(32) + 7] ^= 0xFF
    Path(path).write_bytes(data)
    off.load("r", [(6, key(0)), (7, key(1)), (8, key(2))])
    off.wait(10)
    rep = off.poll()
    assert rep.loaded == {"r": 1} and rep.removed == [key(1)]
    after = snapshot(tensors)
    assert after[6] == before[0] and after[7] == before[7] and after[8] == before[8]
    st = off.stats
    assert (st.num_pages_loaded, st.num_pages_failed, st.num_corrupt) == (1, 2, 1)
    assert store.keys() == [key(2), key(0)]  # key(0) read last


def test_load_of_a_missing_first_key_loads_none(tmp_path):
    tensors = make_tensors([torch.float16])
    off = KVOffloader(tensors, HostKVStore(10**9))
    off.load("r", [(6, key(0))])
    off.wait(10)
    assert off.poll().loaded == {"r": 0}


def test_staged_but_unwritten_key_loads_from_staging():
    tensors = make_tensors([torch.bfloat16, torch.int8])
    store = GatedStore()
    off = KVOffloader(tensors, store)
    before = snapshot(tensors)
    off.save([(0, key(0))])
    assert store.entered.wait(10)  # the I/O thread is inside that write
    off.save([(4, key(4)), (5, key(5))])
    tensors[0][:, 4:6] = 0  # the blocks are reused at once; their pages live on in staging
    off.load("r", [(10, key(4)), (11, key(5))])
    store.gate.set()
    off.wait(10)
    rep = off.poll()
    assert rep.loaded == {"r": 2}
    assert snapshot(tensors)[10:12] == [before[4], before[5]]
    assert off.stats.num_pages_from_staging == 2
    off.drain()
    # The load ran before key(4) and key(5) were written, and never read the store.
    assert store.calls == [("write", key(0)), ("write", key(4)), ("write", key(5))]
    assert store.keys() == [key(0), key(4), key(5)]


def test_loads_go_ahead_of_queued_saves(tmp_path):
    tensors = make_tensors([torch.float16])
    store = GatedStore()
    store.gate.set()
    off = KVOffloader(tensors, store)
    off.save([(0, key(100))])
    off.drain()
    store.gate.clear()
    store.entered.clear()
    off.save([(i, key(i)) for i in range(8)])  # the thread blocks in the first write; seven wait behind it
    assert store.entered.wait(10)
    off.load("r", [(11, key(100))])
    store.gate.set()
    off.wait(10)
    off.drain()
    assert off.poll().loaded == {"r": 1}
    assert store.calls[:3] == [("write", key(100)), ("write", key(0)), ("read", key(100))]  # only the save under way went first


def test_dropped_saves_when_staging_is_full():
    tensors = make_tensors([torch.float16])
    store = GatedStore()
    off = KVOffloader(tensors, store, max_staged_bytes=2 * len(page(tensors, 0)) + 100)
    off.save([(i, key(i)) for i in range(5)])
    st = off.stats
    assert (st.num_saves, st.num_dropped_saves, st.staged_bytes) == (2, 3, 2 * off.page_bytes)
    assert off.poll().removed == [key(2), key(3), key(4)]
    store.gate.set()
    off.drain()
    assert store.keys() == [key(0), key(1)]
    off.save([(2, key(2))])  # room again
    off.drain()
    assert store.keys() == [key(0), key(1), key(2)] and off.stats.staged_bytes_peak == 2 * off.page_bytes


def test_keys_stored_or_staged_are_skipped():
    tensors = make_tensors([torch.float16])
    store = GatedStore()
    off = KVOffloader(tensors, store)
    store.gate.set()
    off.save([(0, key(0))])
    off.drain()
    store.gate.clear()
    off.save([(1, key(1)), (0, key(0)), (1, key(1))])
    assert off.stats.num_skipped_saves == 2 and off.stats.num_saves == 2
    store.gate.set()
    off.drain()
    assert [c for c in store.calls if c[0] == "write"] == [("write", key(0)), ("write", key(1))]


def test_failed_write_is_reported_removed(tmp_path):
    tensors = make_tensors([torch.float16])
    store = HostKVStore(len(page(tensors, 0)) - 1)  # too small for any page
    off = KVOffloader(tensors, store)
    off.save([(0, key(0))])
    off.drain()
    assert off.poll().removed == [key(0)]
    assert off.stats.num_failed_saves == 1 and off.stats.num_write_errors == 1


def test_store_eviction_is_reported_through_poll():
    tensors = make_tensors([torch.float16])
    off = KVOffloader(tensors, HostKVStore(2 * len(page(tensors, 0))))
    off.save([(i, key(i)) for i in range(3)])
    off.drain()
    assert off.poll().removed == [key(0)]
    assert off.poll().removed == []


def test_wait_returns_on_a_finished_load_or_timeout():
    tensors = make_tensors([torch.float16])
    off = KVOffloader(tensors, HostKVStore(10**9))
    t0 = time.perf_counter()
    off.wait(5)  # nothing queued: at once
    assert time.perf_counter() - t0 < 1
    off.load("empty", [])
    off.wait(5)
    assert off.poll().loaded == {"empty": 0}
    off.save([(0, key(0))])
    off.load("a", [(5, key(0))])
    off.wait(5)
    off.wait(5)  # finished and not polled yet: returns at once
    assert off.poll().loaded == {"a": 1}
    off.close()


def test_bad_input():
    tensors = make_tensors([torch.float16])
    store = HostKVStore(10**9)
    with pytest.raises(ValueError, match="non-empty"):
        KVOffloader([], store)
    with pytest.raises(ValueError, match=r"\[2, num_blocks"):
        KVOffloader([torch.zeros(2, 3, 4)], store)
    with pytest.raises(ValueError, match="blocks"):
        KVOffloader([tensors[0], torch.zeros(2, 3, 4, 2, 8)], store)
    with pytest.raises(ValueError, match="listed twice"):
        KVOffloader([tensors[0], tensors[0]], store)
    with pytest.raises(ValueError, match="contiguous"):
        KVOffloader([tensors[0].transpose(2, 3)], store)
    with pytest.raises(ValueError, match="at least one page"):
        KVOffloader(tensors, store, max_staged_bytes=10)
    off = KVOffloader(tensors, store)
    with pytest.raises(ValueError, match="outside"):
        off.save([(NUM_BLOCKS, key(0))])
    with pytest.raises(ValueError, match="outside"):
        off.load("r", [(-1, key(0))])
    with pytest.raises(ValueError, match="key"):
        off.save([(0, "not bytes")])
    off.load("r", [(0, key(0))])
    with pytest.raises(ValueError, match="already has a load"):
        off.load("r", [(1, key(1))])
    off.close()
    with pytest.raises(RuntimeError, match="closed"):
        off.save([(0, key(0))])


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc")
def test_resident_memory_stays_near_the_staging_bound(tmp_path):
    # 300 pages of 400 KB (120 MB) through the disk tier with 8 MiB of staging, 16 pages a step
    # and no waiting: resident memory grows by about the staging buffer, not by what was written.
    tensors = [torch.randn(2, 16, 16, 8, 400).to(torch.float16) for _ in range(2)]
    store = DiskKVStore(str(tmp_path / "tier"), IDENTITY, 10**10, fsync=False)
    staged = 8 * 2**20
    off = KVOffloader(tensors, store, max_staged_bytes=staged)
    assert off.page_bytes == 400 * 1024
    off.save([(0, key(-1))])
    off.drain()
    base = _rss_bytes()
    peak = base
    n = 0
    while n < 300:
        off.save([(i % 16, key(n + i)) for i in range(16)])
        n += 16
        peak = max(peak, _rss_bytes())
        time.sleep(0.002)
    off.drain()
    peak = max(peak, _rss_bytes())
    st = off.stats
    assert st.num_writes >= 20  # what the disk kept up with is written; the rest dropped rather than piled up
    assert st.num_writes + st.num_dropped_saves == n + 1
    assert st.staged_bytes_peak <= staged
    assert peak - base < staged + 16 * 2**20, (peak - base) / 2**20
    off.close()


# ---- a hybrid model's recurrent states: [num_slots, ...] tensors saved and loaded beside pages ---

NUM_SLOTS = 5


def make_states(seed: int = 1) -> list[torch.Tensor]:
    """Two recurrent layers' state tensors (a conv window in bfloat16, a float32 matrix state)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(2):
        out += [torch.randn(NUM_SLOTS, 6, 3, generator=g).to(torch.bfloat16), torch.randn(NUM_SLOTS, 2, 4, 4, generator=g)]
    return out


def state_of(states: list[torch.Tensor], slot: int) -> bytes:
    return b"".join(t[slot].contiguous().view(torch.uint8).cpu().numpy().tobytes() for t in states)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_states_round_trip_beside_pages(tmp_path):
    tensors = [t.cuda() for t in make_tensors([torch.bfloat16])]
    states = [t.cuda() for t in make_states()]
    off = KVOffloader(tensors, store_of("disk", tmp_path), state_tensors=states)
    pages, saved = snapshot(tensors), state_of(states, 1)
    off.save([(1, key(1))], [(1, key(100))])
    for t in states:
        t[1] = 0
    off.drain()
    off.load("r", [(5, key(1))], state_item=(4, key(100)))
    off.wait(10)
    assert off.poll().loaded == {"r": 2}
    assert state_of(states, 4) == saved and snapshot(tensors)[5] == pages[1]
    off.close()


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_a_state_saves_and_loads_first_into_another_slot_beside_pages(tmp_path, kind):
    tensors, states = make_tensors([torch.bfloat16]), make_states()
    off = KVOffloader(tensors, store_of(kind, tmp_path), state_tensors=states)
    assert off.state_bytes == len(state_of(states, 0)) and off.stats.state_bytes == off.state_bytes
    pages, saved_state = snapshot(tensors), state_of(states, 1)
    off.save([(0, key(0)), (1, key(1))], [(1, key(100))])
    for t in states:
        t[1] = 0  # the slot is reused at once: its state lives on in staging
    off.drain()
    off.load("r", [(6, key(0)), (7, key(1))], state_item=(3, key(100)))
    off.wait(10)
    assert off.poll().loaded == {"r": 3}
    assert state_of(states, 3) == saved_state and snapshot(tensors)[6:8] == pages[0:2]
    st = off.stats
    assert (st.num_state_saves, st.num_states_loaded, st.num_pages_loaded) == (1, 1, 3)
    off.close()


def test_a_missing_state_stops_the_load_before_its_pages(tmp_path):
    tensors, states = make_tensors([torch.float16]), make_states()
    off = KVOffloader(tensors, HostKVStore(10**9), state_tensors=states)
    off.save([(0, key(0))])
    off.drain()
    before = snapshot(tensors)
    off.load("r", [(6, key(0))], state_item=(2, key(100)))
    off.wait(10)
    assert off.poll().loaded == {"r": 0} and snapshot(tensors)[6] == before[6]


def test_a_state_stored_under_a_pages_size_is_dropped(tmp_path):
    # A state key whose file holds a page (the identity left a shape out): dropped, not copied.
    tensors, states = make_tensors([torch.float16]), make_states()
    store = HostKVStore(10**9)
    off = KVOffloader(tensors, store, state_tensors=states)
    off.save([(0, key(100))])
    off.drain()
    off.load("r", [], state_item=(2, key(100)))
    off.wait(10)
    rep = off.poll()
    assert rep.loaded == {"r": 0} and rep.removed == [key(100)] and not store.contains(key(100))


def test_staging_keeps_room_for_states_and_pages():
    tensors, states = make_tensors([torch.float16]), make_states()
    page_bytes, state_bytes = len(page(tensors, 0)), len(state_of(states, 0))
    with pytest.raises(ValueError, match="one page and one state"):
        KVOffloader(tensors, HostKVStore(10**9), max_staged_bytes=page_bytes + state_bytes - 1, state_tensors=states)
    store = GatedStore()
    off = KVOffloader(tensors, store, max_staged_bytes=page_bytes + state_bytes, state_tensors=states)
    off.save([(0, key(0)), (1, key(1))], [(0, key(100)), (1, key(101))])  # one of each fits
    st = off.stats
    assert (st.num_saves, st.num_dropped_saves, st.staged_bytes) == (2, 2, page_bytes + state_bytes)
    assert off.poll().removed == [key(1), key(101)]
    store.gate.set()
    off.close()


def test_bad_state_input():
    tensors, states = make_tensors([torch.float16]), make_states()
    store = HostKVStore(10**9)
    with pytest.raises(ValueError, match="num_slots"):
        KVOffloader(tensors, store, state_tensors=[torch.zeros(4)])
    with pytest.raises(ValueError, match="slots"):
        KVOffloader(tensors, store, state_tensors=[states[0], torch.zeros(NUM_SLOTS + 1, 3)])
    with pytest.raises(ValueError, match="listed twice"):
        KVOffloader(tensors, store, state_tensors=[states[0], states[0]])
    off = KVOffloader(tensors, store, state_tensors=states)
    with pytest.raises(ValueError, match="outside"):
        off.save([], [(NUM_SLOTS, key(0))])
    with pytest.raises(ValueError, match="without state tensors"):
        KVOffloader(tensors, store).load("r", [], state_item=(0, key(0)))
    off.close()
