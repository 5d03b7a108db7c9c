"""Moving KV pages between the paged KV cache tensors and a ``KVStore``, beside the engine's steps.

A block's page is ``t[:, block_id]`` of every KV cache tensor in turn; its payload in the store is
those bytes concatenated. Saves copy the page out on the engine's thread at once (the step about to
run may overwrite the block) into a bounded staging buffer, and one background I/O thread writes
them; loads are read and copied into their blocks on that thread, ahead of any queued save, and
the engine learns which finished from ``poll``. The staging buffer is the only memory this adds.
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


@dataclass
class _Load:
    req_id: str
    items: list[tuple[int, bytes]]
    queued_at: float


@dataclass
class _Layout:
    """One tensor's part of a page: where it sits in the payload and its shape as bytes."""

    offset: int
    nbytes: int
    shape: tuple[int, ...]  # [2, block_size, num_kv_heads, row_width * element size]
    as_bytes: torch.Tensor  # the whole tensor viewed as uint8, [2, num_blocks, *shape[1:]]
    as_numpy: Optional[np.ndarray]  # the same memory as a numpy array (CPU tensors)


class KVOffloader:
    """Saves and loads pages of ``kv_tensors`` through ``store`` on one daemon I/O thread.

    The engine's thread calls ``save``, ``load``, ``poll``, ``wait``, ``drain`` and ``close``.
    """

    def __init__(self, kv_tensors: list[torch.Tensor], store: KVStore, max_staged_bytes: int = 256 * 2**20) -> None:
        if not isinstance(kv_tensors, (list, tuple)) or not kv_tensors:
            raise ValueError("kv_tensors must be a non-empty list of KV cache tensors")
        first = kv_tensors[0]
        seen: set[int] = set()
        self._layouts: list[_Layout] = []
        offset = 0
        for i, t in enumerate(kv_tensors):
            if not isinstance(t, torch.Tensor) or t.dim() != 5 or t.shape[0] != 2:
                raise ValueError(
                    f"kv_tensors[{i}] must be a tensor [2, num_blocks, block_size, num_kv_heads, row_width], got {_describe(t)}"
                )
            if t.shape[1] != first.shape[1] or t.device != first.device:
                raise ValueError(
                    f"kv_tensors[{i}] has {t.shape[1]} blocks on {t.device}; kv_tensors[0] has {first.shape[1]} on {first.device}"
                )
            if not t.is_contiguous():
                raise ValueError(f"kv_tensors[{i}] must be contiguous")
            if t.data_ptr() in seen:
                raise ValueError(f"kv_tensors[{i}] is listed twice: pass each distinct KV cache tensor once")
            seen.add(t.data_ptr())
            as_bytes = t.view(torch.uint8)  # byte copies: no dtype (bfloat16, fp8) needs numpy's support
            shape = (2, *as_bytes.shape[2:])
            nbytes = int(np.prod(shape))
            as_numpy = as_bytes.numpy() if t.device.type == "cpu" else None
            self._layouts.append(_Layout(offset, nbytes, shape, as_bytes, as_numpy))
            offset += nbytes
        self.page_bytes = offset
        self.num_blocks = int(first.shape[1])
        self.device = first.device
        if not isinstance(max_staged_bytes, int) or max_staged_bytes < self.page_bytes:
            raise ValueError(f"max_staged_bytes ({max_staged_bytes!r}) must hold at least one page of {self.page_bytes} bytes")
        self.store = store
        self.max_staged_bytes = max_staged_bytes
        self._num_slots = max_staged_bytes // self.page_bytes
        self._is_cuda = self.device.type == "cuda"

        # Staging: allocated on the first save. Its pages are touched only as slots are used, and
        # freed slots are reused last-in first-out, so resident memory follows the backlog's peak.
        self._staging: Optional[torch.Tensor] = None
        self._staging_np: Optional[np.ndarray] = None
        self._free_slots = list(range(self._num_slots - 1, -1, -1))
        self._staged: dict[bytes, int] = {}  # key -> slot, until written
        self._load_buf: Optional[torch.Tensor] = None  # (CUDA) a pinned page between the payload and the device
        self._stream: Optional[torch.cuda.Stream] = None

        self._cv = threading.Condition()
        self._saves: deque[tuple[bytes, int]] = deque()
        self._loads: deque[_Load] = deque()
        self._busy = False
        self._loading: set[str] = set()  # req ids queued or loading
        self._loaded: dict[str, int] = {}  # finished, not yet polled
        self._removed: list[bytes] = []
        self._stopping = False
        self._closed = False
        self._thread: Optional[threading.Thread] = None
        self._stats = OffloaderStats(page_bytes=self.page_bytes, max_staged_bytes=max_staged_bytes)

    # The engine's side.

    def save(self, items: list[tuple[int, bytes]]) -> None:
        """Copy each (block id, key) page out now and queue it for writing; never blocks on I/O."""
        self._check_open()
        for block_id, key in items:
            self._check_item(block_id, key)
        chosen: list[tuple[int, bytes, int]] = []
        with self._cv:
            for block_id, key in items:
                if key in self._staged or self.store.contains(key):
                    self._stats.num_skipped_saves += 1
                    continue
                if not self._free_slots:
                    # Dropping costs a recompute later if the prefix comes back; waiting would stall every request's step now.
                    self._stats.num_dropped_saves += 1
                    self._removed.append(key)
                    continue
                slot = self._free_slots.pop()
                self._staged[key] = slot
                chosen.append((block_id, key, slot))
            self._stats.staged_bytes = len(self._staged) * self.page_bytes
            self._stats.staged_bytes_peak = max(self._stats.staged_bytes_peak, self._stats.staged_bytes)
        if not chosen:
            return
        self._ensure_staging()
        for block_id, _, slot in chosen:
            self._copy_out(block_id, slot)
        with self._cv:
            self._saves.extend((key, slot) for _, key, slot in chosen)
            self._stats.num_saves += len(chosen)
            self._start()
            self._cv.notify_all()

    def load(self, req_id: str, items: list[tuple[int, bytes]]) -> None:
        """Queue reading each (block id, key) into its block, ahead of queued saves; ``poll`` reports it."""
        self._check_open()
        if not isinstance(req_id, str):
            raise ValueError(f"req_id must be a str, got {req_id!r}")
        for block_id, key in items:
            self._check_item(block_id, key)
        with self._cv:
            if req_id in self._loading or req_id in self._loaded:
                raise ValueError(f"request {req_id!r} already has a load queued or unreported; poll() it first")
            if not items:
                self._loaded[req_id] = 0
                self._cv.notify_all()
                return
            self._loading.add(req_id)
            self._loads.append(_Load(req_id, list(items), time.perf_counter()))
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
        self._staging = self._staging_np = self._load_buf = None

    @property
    def stats(self) -> OffloaderStats:
        tier = asdict(self.store.stats)
        with self._cv:
            ours = {k: v for k, v in asdict(self._stats).items() if k not in tier}
        return OffloaderStats(**tier, **ours)

    # Copies.

    def _copy_out(self, block_id: int, slot: int) -> None:
        """Block ``block_id``'s page into staging slot ``slot`` (synchronous: the block may be overwritten next)."""
        base = slot * self.page_bytes
        for lay in self._layouts:
            if lay.as_numpy is not None:
                # numpy: a plain single-threaded memcpy, off torch's intra-op thread pool the step uses.
                dst = self._staging_np[base + lay.offset : base + lay.offset + lay.nbytes].reshape(lay.shape)
                np.copyto(dst, lay.as_numpy[:, block_id])
            else:
                self._staging[base + lay.offset : base + lay.offset + lay.nbytes].view(lay.shape).copy_(lay.as_bytes[:, block_id])

    def _copy_in(self, block_id: int, src: np.ndarray) -> None:
        """A whole payload (``page_bytes`` uint8) into block ``block_id``'s page of every tensor."""
        if not self._is_cuda:
            for lay in self._layouts:
                np.copyto(lay.as_numpy[:, block_id], src[lay.offset : lay.offset + lay.nbytes].reshape(lay.shape))
            return
        if self._load_buf is None:
            self._load_buf = torch.empty(self.page_bytes, dtype=torch.uint8, pin_memory=True)
            self._stream = torch.cuda.Stream(self.device)
        np.copyto(self._load_buf.numpy(), src)
        # A side stream: the copy runs beside the engine's kernels on the default stream rather
        # than queueing behind them; done before the buffer is reused and before the load reports.
        with torch.cuda.stream(self._stream):
            for lay in self._layouts:
                lay.as_bytes[:, block_id].copy_(self._load_buf[lay.offset : lay.offset + lay.nbytes].view(lay.shape), non_blocking=True)
        self._stream.synchronize()

    def _ensure_staging(self) -> None:
        if self._staging is None:
            # Pinned for a GPU cache: device-to-host copies at full speed. Pinned memory is resident at once.
            self._staging = torch.empty(self._num_slots * self.page_bytes, dtype=torch.uint8, pin_memory=self._is_cuda)
            self._staging_np = self._staging.numpy()

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
                    job: _Load | tuple[bytes, int] = self._loads.popleft()
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

    def _do_save(self, key: bytes, slot: int) -> None:
        base = slot * self.page_bytes
        try:
            ok = self.store.write(key, memoryview(self._staging_np[base : base + self.page_bytes]))
        except Exception:  # a store's bug must not kill the thread every later load waits on
            logger.exception("KV tier write of %s failed", key.hex())
            ok = False
        with self._cv:
            del self._staged[key]
            self._free_slots.append(slot)
            self._stats.staged_bytes = len(self._staged) * self.page_bytes
            if not ok:
                self._stats.num_failed_saves += 1
                self._removed.append(key)

    def _do_load(self, job: _Load) -> None:
        done = 0
        from_staging = 0
        try:
            for block_id, key in job.items:
                with self._cv:
                    slot = self._staged.get(key)
                # Only this thread frees a staged slot, so it stays put while read here.
                if slot is not None:
                    src = self._staging_np[slot * self.page_bytes : (slot + 1) * self.page_bytes]
                    from_staging += 1
                else:
                    payload = self.store.read(key)
                    if payload is None:
                        break
                    if len(payload) != self.page_bytes:
                        # Same identity, other page geometry: the identity left a shape out.
                        logger.warning("KV tier entry %s holds %d bytes, a page is %d; dropped", key.hex(), len(payload), self.page_bytes)
                        self.store.remove(key)
                        with self._cv:
                            self._removed.append(key)
                        break
                    src = np.frombuffer(payload, dtype=np.uint8)
                self._copy_in(block_id, src)
                done += 1
        except Exception:  # the request recomputes what did not load; the thread goes on
            logger.exception("KV tier load for request %s failed after %d pages", job.req_id, done)
        with self._cv:
            self._loading.discard(job.req_id)
            self._loaded[job.req_id] = done
            self._stats.num_loads += 1
            self._stats.num_pages_loaded += done
            self._stats.num_pages_failed += len(job.items) - done
            self._stats.num_pages_from_staging += from_staging
            self._stats.load_seconds += time.perf_counter() - job.queued_at

    # Checks.

    def _check_open(self) -> None:
        if self._closed or self._stopping:
            raise RuntimeError("the KV offloader is closed")

    def _check_item(self, block_id: int, key: bytes) -> None:
        if not isinstance(block_id, int) or not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id!r} is outside the KV cache's {self.num_blocks} blocks")
        check_key(key)


def _describe(t: object) -> str:
    return f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
