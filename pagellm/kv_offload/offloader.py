"""Moving KV pages (and a hybrid model's recurrent states) between the engine's cache tensors and a
``KVStore``, beside the engine's steps.

A block's page is ``t[:, block_id]`` of every KV cache tensor in turn; its payload in the store is
those bytes concatenated. A hybrid model's state is ``t[slot]`` of every recurrent state tensor in
turn, saved and loaded the same way under its own keys. Saves copy the page out on the engine's
thread at once (the step about to run may overwrite the block) into a bounded staging buffer, and
one background I/O thread writes them; loads are read and copied into their blocks on that thread,
ahead of any queued save, and the engine learns which finished from ``poll``. The staging buffer is
the only memory this adds.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Optional

import numpy as np
import torch

from pagellm.kv_offload.store import KVStore, KVTierStats, check_key

logger = logging.getLogger(__name__)

# Spaces of ids an item lives in: KV cache blocks, or recurrent state slots.
PAGES, STATES = 0, 1


@dataclass
class OffloadReport:
    """What finished since the last ``poll``."""

    loaded: dict[str, int] = field(default_factory=dict)  # req id -> leading items loaded (fewer than asked: the rest failed)
    removed: list[bytes] = field(default_factory=list)  # keys the tier no longer holds (or never got)


@dataclass
class OffloaderStats(KVTierStats):
    """The store's counters and the offloader's own."""

    page_bytes: int = 0
    max_staged_bytes: int = 0
    num_saves: int = 0  # pages copied out and queued for writing
    num_skipped_saves: int = 0  # already stored or staged
    num_dropped_saves: int = 0  # staging full: not saved
    num_failed_saves: int = 0  # the store's write failed
    num_loads: int = 0  # load() calls finished
    num_pages_loaded: int = 0
    num_pages_failed: int = 0  # items not loaded (the failed key and those after it)
    num_pages_from_staging: int = 0  # loaded from a page still waiting to be written
    load_seconds: float = 0.0  # from load() to done, summed over loads
    staged_bytes: int = 0
    staged_bytes_peak: int = 0
    state_bytes: int = 0  # one recurrent state's payload (0: no states)
    num_state_saves: int = 0  # states copied out and queued (also in num_saves)
    num_states_loaded: int = 0  # (also in num_pages_loaded)


@dataclass
class _Load:
    req_id: str
    items: list[tuple[int, int, bytes]]  # (space, id, key)
    queued_at: float


@dataclass
class _Layout:
    """One tensor's part of an item: where it sits in the payload and its shape as bytes."""

    offset: int
    nbytes: int
    shape: tuple[int, ...]  # the item's part as bytes: [2, block_size, heads, row bytes] or a state's [*shape, bytes]
    as_bytes: torch.Tensor  # the whole tensor viewed as uint8
    as_numpy: Optional[np.ndarray]  # the same memory as a numpy array (CPU tensors)
    dim: int  # the dimension ids index: 1 for KV ([2, num_blocks, ...]), 0 for states ([num_slots, ...])

    def part(self, item_id: int, numpy: bool):
        t = self.as_numpy if numpy else self.as_bytes
        return t[:, item_id] if self.dim == 1 else t[item_id]


@dataclass
class _Space:
    """The tensors one kind of item spans, and the staging slots of its items."""

    name: str
    layouts: list[_Layout]
    item_bytes: int
    num_ids: int
    num_slots: int = 0
    staging: Optional[torch.Tensor] = None
    staging_np: Optional[np.ndarray] = None
    free_slots: list[int] = field(default_factory=list)

    def staged(self, slot: int) -> np.ndarray:
        return self.staging_np[slot * self.item_bytes : (slot + 1) * self.item_bytes]


def _layouts(tensors: list[torch.Tensor], dim: int, what: str, seen: set[int]) -> list[_Layout]:
    layouts, offset = [], 0
    ids = "blocks" if dim == 1 else "slots"
    first = tensors[0]
    for i, t in enumerate(tensors):
        if dim == 1 and (not isinstance(t, torch.Tensor) or t.dim() != 5 or t.shape[0] != 2):
            raise ValueError(f"{what}[{i}] must be a tensor [2, num_blocks, block_size, num_kv_heads, row_width], got {_describe(t)}")
        if dim == 0 and (not isinstance(t, torch.Tensor) or t.dim() < 2):
            raise ValueError(f"{what}[{i}] must be a tensor [num_slots, ...], got {_describe(t)}")
        if t.shape[dim] != first.shape[dim] or t.device != first.device:
            raise ValueError(f"{what}[{i}] has {t.shape[dim]} {ids} on {t.device}; {what}[0] has {first.shape[dim]} on {first.device}")
        if not t.is_contiguous():
            raise ValueError(f"{what}[{i}] must be contiguous")
        if t.data_ptr() in seen:
            raise ValueError(f"{what}[{i}] is listed twice: pass each distinct cache tensor once")
        seen.add(t.data_ptr())
        as_bytes = t.view(torch.uint8)  # byte copies: no dtype (bfloat16, fp8) needs numpy's support
        shape = (2, *as_bytes.shape[2:]) if dim == 1 else tuple(as_bytes.shape[1:])
        nbytes = int(np.prod(shape))
        as_numpy = as_bytes.numpy() if t.device.type == "cpu" else None
        layouts.append(_Layout(offset, nbytes, shape, as_bytes, as_numpy, dim))
        offset += nbytes
    return layouts


class KVOffloader:
    """Saves and loads pages of ``kv_tensors`` (and states of ``state_tensors``, a hybrid model's
    recurrent layers' ``[num_slots, ...]`` tensors) through ``store`` on one daemon I/O thread.

    The engine's thread calls ``save``, ``load``, ``poll``, ``wait``, ``drain`` and ``close``.
    """

    def __init__(
        self,
        kv_tensors: list[torch.Tensor],
        store: KVStore,
        max_staged_bytes: int = 256 * 2**20,
        state_tensors: Optional[list[torch.Tensor]] = None,
    ) -> None:
        if not isinstance(kv_tensors, (list, tuple)) or not kv_tensors:
            raise ValueError("kv_tensors must be a non-empty list of KV cache tensors")
        seen: set[int] = set()
        kv = _layouts(list(kv_tensors), 1, "kv_tensors", seen)
        first = kv_tensors[0]
        self.page_bytes = sum(lay.nbytes for lay in kv)
        self.num_blocks = int(first.shape[1])
        self.device = first.device
        self._spaces = [_Space("block", kv, self.page_bytes, self.num_blocks)]
        self.state_bytes = 0
        if state_tensors:
            states = _layouts(list(state_tensors), 0, "state_tensors", seen)
            if state_tensors[0].device != self.device:
                raise ValueError(f"state_tensors are on {state_tensors[0].device}, kv_tensors on {self.device}")
            self.state_bytes = sum(lay.nbytes for lay in states)
            self._spaces.append(_Space("state slot", states, self.state_bytes, int(state_tensors[0].shape[0])))
        if not isinstance(max_staged_bytes, int) or max_staged_bytes < self.page_bytes + self.state_bytes:
            what = "one page and one state" if self.state_bytes else "one page"
            raise ValueError(
                f"max_staged_bytes ({max_staged_bytes!r}) must hold at least {what} ({self.page_bytes + self.state_bytes} bytes)"
            )
        self.store = store
        self.max_staged_bytes = max_staged_bytes
        # States get a quarter of the staging (at least one); pages the rest.
        if self.state_bytes:
            room = min(max_staged_bytes // 4, max_staged_bytes - self.page_bytes)
            num_state_slots = max(1, room // self.state_bytes)
            self._spaces[STATES].num_slots = num_state_slots
            max_staged_bytes -= num_state_slots * self.state_bytes
        self._spaces[PAGES].num_slots = max_staged_bytes // self.page_bytes
        for space in self._spaces:
            space.free_slots = list(range(space.num_slots - 1, -1, -1))
        self._is_cuda = self.device.type == "cuda"

        # Staging: allocated on the first save. Its pages are touched only as slots are used, and
        # freed slots are reused last-in first-out, so resident memory follows the backlog's peak.
        self._staged: dict[bytes, tuple[int, int]] = {}  # key -> (space, slot), until written
        self._load_bufs: dict[int, torch.Tensor] = {}  # (CUDA) a pinned item per space between the payload and the device
        self._stream: Optional[torch.cuda.Stream] = None

        self._cv = threading.Condition()
        self._saves: deque[tuple[bytes, int, int]] = deque()
        self._loads: deque[_Load] = deque()
        self._busy = False
        self._loading: set[str] = set()  # req ids queued or loading
        self._loaded: dict[str, int] = {}  # finished, not yet polled
        self._removed: list[bytes] = []
        self._stopping = False
        self._closed = False
        self._thread: Optional[threading.Thread] = None
        self._stats = OffloaderStats(page_bytes=self.page_bytes, max_staged_bytes=self.max_staged_bytes, state_bytes=self.state_bytes)

    # The engine's side.

    def save(self, items: list[tuple[int, bytes]], state_items: list[tuple[int, bytes]] = ()) -> None:
        """Copy each (block id, key) page and each (slot, key) state out now and queue it for
        writing; never blocks on I/O."""
        self._check_open()
        jobs = [(PAGES, i, k) for i, k in items] + [(STATES, i, k) for i, k in state_items]
        for space, item_id, key in jobs:
            self._check_item(space, item_id, key)
        chosen: list[tuple[int, int, bytes, int]] = []
        with self._cv:
            for space, item_id, key in jobs:
                if key in self._staged or self.store.contains(key):
                    self._stats.num_skipped_saves += 1
                    continue
                free = self._spaces[space].free_slots
                if not free:
                    # Dropping costs a recompute later if the prefix comes back; waiting would stall every request's step now.
                    self._stats.num_dropped_saves += 1
                    self._removed.append(key)
                    continue
                slot = free.pop()
                self._staged[key] = (space, slot)
                chosen.append((space, item_id, key, slot))
            self._update_staged_bytes()
        if not chosen:
            return
        for space, item_id, _, slot in chosen:
            self._copy_out(space, item_id, slot)
        with self._cv:
            self._saves.extend((key, space, slot) for space, _, key, slot in chosen)
            self._stats.num_saves += len(chosen)
            self._stats.num_state_saves += sum(1 for c in chosen if c[0] == STATES)
            self._start()
            self._cv.notify_all()

    def load(self, req_id: str, items: list[tuple[int, bytes]], state_item: Optional[tuple[int, bytes]] = None) -> None:
        """Queue reading each (block id, key) into its block, after the (slot, key) ``state_item``
        into its slot if one is given, ahead of queued saves; ``poll`` reports how many of those
        items (the state counting first) loaded."""
        self._check_open()
        if not isinstance(req_id, str):
            raise ValueError(f"req_id must be a str, got {req_id!r}")
        jobs = ([(STATES, *state_item)] if state_item is not None else []) + [(PAGES, i, k) for i, k in items]
        for space, item_id, key in jobs:
            self._check_item(space, item_id, key)
        with self._cv:
            if req_id in self._loading or req_id in self._loaded:
                raise ValueError(f"request {req_id!r} already has a load queued or unreported; poll() it first")
            if not jobs:
                self._loaded[req_id] = 0
                self._cv.notify_all()
                return
            self._loading.add(req_id)
            self._loads.append(_Load(req_id, jobs, time.perf_counter()))
            self._start()
            self._cv.notify_all()

    def poll(self) -> OffloadReport:
        """Loads finished and keys dropped since the last call."""
        removed = self.store.take_removed()
        with self._cv:
            loaded, self._loaded = self._loaded, {}
            removed += self._removed
            self._removed = []
        return OffloadReport(loaded, list(dict.fromkeys(removed)))

    def wait(self, timeout_s: float) -> None:
        """Block until a load finishes (or one is waiting to be polled), none is queued, or ``timeout_s``."""
        with self._cv:
            self._cv.wait_for(lambda: bool(self._loaded) or not self._loading, timeout=timeout_s)

    def drain(self, timeout_s: float = 30.0) -> None:
        """Wait until every queued save and load is done; TimeoutError if that takes over ``timeout_s``."""
        with self._cv:
            if not self._cv.wait_for(lambda: not (self._saves or self._loads or self._busy), timeout=timeout_s):
                raise TimeoutError(f"KV offload I/O still queued after {timeout_s} s ({len(self._saves)} saves, {len(self._loads)} loads)")

    def close(self) -> None:
        """Finish queued I/O (up to 30 s), stop the thread and free the staging buffer."""
        if self._closed:
            return
        try:
            self.drain()
        except TimeoutError as e:
            logger.warning("closing the KV offloader with I/O unfinished: %s", e)
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30.0)
        self._closed = True
        for space in self._spaces:
            space.staging = space.staging_np = None
        self._load_bufs = {}

    @property
    def stats(self) -> OffloaderStats:
        tier = asdict(self.store.stats)
        with self._cv:
            ours = {k: v for k, v in asdict(self._stats).items() if k not in tier}
        return OffloaderStats(**tier, **ours)

    @property
    def _staging(self) -> Optional[torch.Tensor]:
        """The pages' staging buffer (None until the first save)."""
        return self._spaces[PAGES].staging

    # Copies.

    def _copy_out(self, space_id: int, item_id: int, slot: int) -> None:
        """An item's bytes into its staging slot (synchronous: the block or slot may be overwritten next)."""
        space = self._ensure_staging(space_id)
        base = slot * space.item_bytes
        for lay in space.layouts:
            if lay.as_numpy is not None:
                # numpy: a plain single-threaded memcpy, off torch's intra-op thread pool the step uses.
                dst = space.staging_np[base + lay.offset : base + lay.offset + lay.nbytes].reshape(lay.shape)
                np.copyto(dst, lay.part(item_id, numpy=True))
            else:
                space.staging[base + lay.offset : base + lay.offset + lay.nbytes].view(lay.shape).copy_(lay.part(item_id, numpy=False))

    def _copy_in(self, space_id: int, item_id: int, src: np.ndarray) -> None:
        """A whole payload (uint8) into item ``item_id`` of every tensor of its space."""
        space = self._spaces[space_id]
        if not self._is_cuda:
            for lay in space.layouts:
                np.copyto(lay.part(item_id, numpy=True), src[lay.offset : lay.offset + lay.nbytes].reshape(lay.shape))
            return
        buf = self._load_bufs.get(space_id)
        if buf is None:
            buf = self._load_bufs[space_id] = torch.empty(space.item_bytes, dtype=torch.uint8, pin_memory=True)
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        np.copyto(buf.numpy(), src)
        # A side stream: the copy runs beside the engine's kernels on the default stream rather
        # than queueing behind them; done before the buffer is reused and before the load reports.
        with torch.cuda.stream(self._stream):
            for lay in space.layouts:
                lay.part(item_id, numpy=False).copy_(buf[lay.offset : lay.offset + lay.nbytes].view(lay.shape), non_blocking=True)
        self._stream.synchronize()

    def _ensure_staging(self, space_id: int) -> _Space:
        space = self._spaces[space_id]
        if space.staging is None:
            # Pinned for a GPU cache: device-to-host copies at full speed. Pinned memory is resident at once.
            space.staging = torch.empty(space.num_slots * space.item_bytes, dtype=torch.uint8, pin_memory=self._is_cuda)
            space.staging_np = space.staging.numpy()
        return space

    def _update_staged_bytes(self) -> None:
        """Under the lock: the staged bytes now, and their peak."""
        self._stats.staged_bytes = sum(self._spaces[s].item_bytes for s, _ in self._staged.values())
        self._stats.staged_bytes_peak = max(self._stats.staged_bytes_peak, self._stats.staged_bytes)

    # The I/O thread.

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pagellm-kv-offload", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._loads or self._saves or self._stopping)
                if self._loads:
                    job: _Load | tuple[bytes, int, int] = self._loads.popleft()
                elif self._saves:
                    job = self._saves.popleft()
                else:
                    return
                self._busy = True
            try:
                if isinstance(job, _Load):
                    self._do_load(job)
                else:
                    self._do_save(*job)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def _do_save(self, key: bytes, space_id: int, slot: int) -> None:
        space = self._spaces[space_id]
        try:
            ok = self.store.write(key, memoryview(space.staged(slot)))
        except Exception:  # a store's bug must not kill the thread every later load waits on
            logger.exception("KV tier write of %s failed", key.hex())
            ok = False
        with self._cv:
            del self._staged[key]
            space.free_slots.append(slot)
            self._update_staged_bytes()
            if not ok:
                self._stats.num_failed_saves += 1
                self._removed.append(key)

    def _do_load(self, job: _Load) -> None:
        done = 0
        from_staging = 0
        num_states = 0
        try:
            for space_id, item_id, key in job.items:
                space = self._spaces[space_id]
                with self._cv:
                    staged = self._staged.get(key)
                # Only this thread frees a staged slot, so it stays put while read here.
                if staged is not None and staged[0] == space_id:
                    src = space.staged(staged[1])
                    from_staging += 1
                else:
                    payload = self.store.read(key)
                    if payload is None:
                        break
                    if len(payload) != space.item_bytes:
                        # Same identity, other geometry: the identity left a shape out.
                        logger.warning(
                            "KV tier entry %s holds %d bytes, a %s's is %d; dropped", key.hex(), len(payload), space.name, space.item_bytes
                        )
                        self.store.remove(key)
                        with self._cv:
                            self._removed.append(key)
                        break
                    src = np.frombuffer(payload, dtype=np.uint8)
                self._copy_in(space_id, item_id, src)
                done += 1
                num_states += space_id == STATES
        except Exception:  # the request recomputes what did not load; the thread goes on
            logger.exception("KV tier load for request %s failed after %d items", job.req_id, done)
        with self._cv:
            self._loading.discard(job.req_id)
            self._loaded[job.req_id] = done
            self._stats.num_loads += 1
            self._stats.num_pages_loaded += done
            self._stats.num_pages_failed += len(job.items) - done
            self._stats.num_pages_from_staging += from_staging
            self._stats.num_states_loaded += num_states
            self._stats.load_seconds += time.perf_counter() - job.queued_at

    # Checks.

    def _check_open(self) -> None:
        if self._closed or self._stopping:
            raise RuntimeError("the KV offloader is closed")

    def _check_item(self, space_id: int, item_id: int, key: bytes) -> None:
        if space_id >= len(self._spaces):
            raise ValueError("a state item for an offloader without state tensors")
        space = self._spaces[space_id]
        if not isinstance(item_id, int) or not 0 <= item_id < space.num_ids:
            plural = "blocks" if space_id == PAGES else "state slots"
            raise ValueError(f"{space.name} id {item_id!r} is outside the cache's {space.num_ids} {plural}")
        check_key(key)


def _describe(t: object) -> str:
    return f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
