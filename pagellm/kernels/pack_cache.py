"""The kernels' packed weights kept on disk, so that a later start maps them instead of packing.

Packing a checkpoint's weights for the CPU kernels (GGUF blocks repacked for the int8 kernel,
bfloat16 or float32 panels) writes the whole model into fresh memory at every start: most of a
start's time at 1B parameters and up. A file of those panels, mapped from the page cache, costs
nothing until a page is read, as llama.cpp maps its GGUF file.

A load opens a :func:`session` whose key names everything the panels depend on (the checkpoint
files, pagellm's code, the kernel build, precision, rank) and hands it to the load's
:class:`~pagellm.kernels.context.KernelContext`, through which each linear method packs, with
its arguments' signature and the pack as a function (so that what only the pack reads, a
permuted copy of the rows, is not made when it is replayed): :meth:`PackSession.pack`. With no
valid file the calls pack and are recorded, and the file is written afterwards on a thread of its
own, a piece at a time while the model runs no step (:func:`stepping`), so that neither the first
start nor its first requests wait for it. With one, each call takes the next recorded panels after
checking its signature; a difference makes the rest of the load pack, and the file is written
again.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, cast

import torch

logger = logging.getLogger(__name__)

MAGIC = b"PGLMPACK"
FORMAT_VERSION = 1
# Every tensor starts on a page of its own: aligned for any kernel load, and a view of the map.
ALIGN = 4096
# Left free on the cache's disk after a file is written; short of it the file is not written.
MIN_FREE_DISK_BYTES = 1 << 30
# The files of all checkpoints together; past it the least recently used go first.
MAX_CACHE_BYTES = 64 << 30
# pagellm's packages whose code decides what a load packs and how (the C++ is the build's key).
_PACKING_PACKAGES = ("kernels", "layers", "models", "distributed")

# The background write waits until the model has run no step for this long, and writes this much
# at a time, so that a request arriving meanwhile waits for at most one piece.
IDLE_BEFORE_WRITE_S = 1.0
WRITE_PIECE_BYTES = 4 << 20

_writers: list[threading.Thread] = []
# Files this process is writing: a second load of the same slot before the first one's write ends
# (it waits for idle time) leaves the file to it rather than writing the same bytes beside it.
_writing: set[Path] = set()
_writing_lock = threading.Lock()
_last_busy = time.monotonic()
_steps_running = 0
_hurry = threading.Event()  # set while a caller waits for the writes: no more pauses


def mark_busy() -> None:
    """Keeps a background write waiting for the next IDLE_BEFORE_WRITE_S (after a step or a load)."""
    global _last_busy
    _last_busy = time.monotonic()


@contextlib.contextmanager
def stepping() -> Iterator[None]:
    """Around each model step: a background write pauses while the engine serves (a prefill step
    can take seconds, so the write waits for the step's end, not only its start)."""
    global _steps_running
    _steps_running += 1
    try:
        yield
    finally:
        _steps_running -= 1
        mark_busy()


def _wait_until_idle() -> None:
    while not _hurry.is_set():
        quiet = 0.0 if _steps_running else time.monotonic() - _last_busy
        if quiet >= IDLE_BEFORE_WRITE_S:
            return
        _hurry.wait(IDLE_BEFORE_WRITE_S - quiet)


def code_digest() -> str:
    """A digest of the Python sources that choose and call the pack ops."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for package in _PACKING_PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            digest.update(path.relative_to(root).as_posix().encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


@dataclass
class _Entry:
    op: str
    signature: Any
    tensor: Optional[torch.Tensor] = None
    error: Optional[str] = None  # the call raised ValueError with this message (a form it cannot take)


def _normalized(value: Any) -> Any:
    return json.loads(json.dumps(value))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class PackSession:
    """One load's pack calls: replayed from ``path`` when its header holds ``key``, else recorded."""

    def __init__(self, path: Path, key: dict[str, Any]) -> None:
        self.path = path
        self.key = _normalized(key)
        self.entries: list[_Entry] = []
        self.replayed: list[_Entry] = self._read()
        self.diverged = False
        self.mapped_bytes = 0

    def _read(self) -> list[_Entry]:
        try:
            with open(self.path, "rb") as f:
                if f.read(len(MAGIC)) != MAGIC:
                    return []
                (header_len,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(header_len))
            size = os.path.getsize(self.path)
        except (OSError, ValueError, struct.error):
            return []
        if header.get("version") != FORMAT_VERSION or header.get("key") != self.key:
            return []
        try:
            records = header["entries"]
            if any(r.get("offset", 0) + r.get("nbytes", 0) > size for r in records):
                return []  # cut short: a disk that filled up, or a copy
            storage = torch.from_file(str(self.path), shared=False, size=size, dtype=torch.uint8)
            entries = []
            for r in records:
                tensor = None
                if "error" not in r:
                    flat = storage[r["offset"] : r["offset"] + r["nbytes"]]
                    tensor = flat.view(getattr(torch, r["dtype"])).view(r["shape"])
                entries.append(_Entry(r["op"], r["signature"], tensor, r.get("error")))
        except (KeyError, TypeError, AttributeError, RuntimeError, OSError) as e:  # a damaged header
            logger.info("packed weights in %s are unreadable (%s); packing", self.path, e)
            return []
        return entries

    def pack(self, op: str, signature: list[Any], pack: Callable[[], torch.Tensor]) -> torch.Tensor:
        signature = _normalized(signature)
        index = len(self.entries)
        if not self.diverged and index < len(self.replayed):
            recorded = self.replayed[index]
            if recorded.op == op and recorded.signature == signature:
                self.entries.append(recorded)
                if recorded.error is not None:
                    raise ValueError(recorded.error)
                tensor = cast(torch.Tensor, recorded.tensor)
                self.mapped_bytes += tensor.nbytes
                return tensor
        if self.replayed and not self.diverged:
            logger.info("packed weights in %s were made by a different load (call %d); packing the rest", self.path, index)
        self.diverged = True
        try:
            tensor = pack()
        except ValueError as e:
            self.entries.append(_Entry(op, signature, error=str(e)))
            raise
        self.entries.append(_Entry(op, signature, tensor))
        return tensor

    @property
    def complete(self) -> bool:
        """Whether every call was replayed and every recorded panel used."""
        return bool(self.replayed) and not self.diverged and len(self.entries) == len(self.replayed)

    def finish(self) -> Optional[threading.Thread]:
        """After the load: starts writing the file (returned thread) unless it was replayed whole."""
        if self.complete:
            logger.info("packed weights mapped from %s (%.0f MiB)", self.path, self.mapped_bytes / 2**20)
            with contextlib.suppress(OSError):
                os.utime(self.path)  # its last use, for the eviction of the least recently used
            return None
        if not any(e.tensor is not None for e in self.entries):
            return None
        with _writing_lock:
            if self.path in _writing:
                logger.info("packed weights for %s are being written already", self.path)
                return None
            _writing.add(self.path)
        mark_busy()  # what follows the load (the KV cache, warm-up, a server's start) goes first
        thread = threading.Thread(target=self._write_quietly, name="pagellm-pack-cache", daemon=False)
        thread.start()
        _writers.append(thread)
        return thread

    def _write_quietly(self) -> None:
        with contextlib.suppress(AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)  # behind serving, Linux only
        try:
            write(self.path, self.key, self.entries, pace=_wait_until_idle)
        except Exception as e:  # noqa: BLE001 - a cache: the engine serves on whatever happened here
            logger.warning("could not keep the packed weights in %s: %s", self.path, e)
        finally:
            with _writing_lock:
                _writing.discard(self.path)


def wait_for_writes(timeout_s: Optional[float] = None) -> None:
    """Lets files still being written finish: for a process that leaves by ``os._exit``, which
    would end their threads and the files with them. They no longer wait for idle time."""
    _hurry.set()
    try:
        while _writers:
            thread = _writers.pop()
            if thread.is_alive():
                logger.info("finishing the packed-weights file for later starts")
                thread.join(timeout_s)
    finally:
        _hurry.clear()


def write(path: Path, key: dict[str, Any], entries: list[_Entry], pace: Optional[Callable[[], None]] = None) -> bool:
    """Writes ``entries`` under ``key`` to ``path`` (through a temporary file, so a reader sees
    a whole file or none), calling ``pace`` before each WRITE_PIECE_BYTES; False when the disk
    would be left with less than MIN_FREE_DISK_BYTES."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_orphans(path.parent)
    records: list[dict[str, Any]] = []
    offset = 0
    for e in entries:
        if e.tensor is None:
            records.append({"op": e.op, "signature": e.signature, "error": e.error})
            continue
        nbytes = e.tensor.nbytes
        records.append(
            {"op": e.op, "signature": e.signature, "dtype": _dtype_name(e.tensor.dtype), "shape": list(e.tensor.shape),
             "offset": offset, "nbytes": nbytes}
        )
        offset += -(-nbytes // ALIGN) * ALIGN
    data_bytes = offset
    # The data follows the header's page(s); offsets so far count from the data's start.
    data_start = ALIGN
    while True:
        placed = [{**r, "offset": r["offset"] + data_start} if "offset" in r else r for r in records]
        header = json.dumps({"version": FORMAT_VERSION, "key": key, "entries": placed}).encode()
        if len(MAGIC) + 8 + len(header) <= data_start:
            break
        data_start += ALIGN
    _evict(path.parent, keep=path, room=data_start + data_bytes)
    if shutil.disk_usage(path.parent).free < data_start + data_bytes + MIN_FREE_DISK_BYTES:
        logger.info("not keeping the packed weights (%.0f MiB): too little free disk in %s", data_bytes / 2**20, path.parent)
        return False
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC + struct.pack("<Q", len(header)) + header)
            for e, r in zip(entries, placed):
                if e.tensor is not None:
                    f.seek(r["offset"])
                    data = memoryview(e.tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
                    for start in range(0, len(data), WRITE_PIECE_BYTES):
                        if pace is not None:
                            pace()
                        f.write(data[start : start + WRITE_PIECE_BYTES])
            f.truncate(max((r["offset"] + r["nbytes"] for r in placed if "offset" in r), default=data_start))
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    logger.info("kept the packed weights in %s (%.0f MiB) for later starts to map", path, data_bytes / 2**20)
    return True


def _evict(directory: Path, keep: Path, room: int) -> None:
    """Deletes the least recently used files until the others and ``room`` more fit in MAX_CACHE_BYTES."""
    files = []
    for other in directory.glob("*.pack"):
        with contextlib.suppress(OSError):
            if other != keep:
                stat = other.stat()
                files.append((stat.st_mtime_ns, stat.st_size, other))
    total = sum(size for _, size, _ in files) + room
    for _, size, other in sorted(files):
        if total <= MAX_CACHE_BYTES:
            break
        with contextlib.suppress(OSError):
            other.unlink()
            logger.info("removed the least recently used packed weights, %s (%.0f MiB)", other, size / 2**20)
        total -= size


def _remove_orphans(directory: Path) -> None:
    """Temporary files of writers that died before they finished."""
    for tmp in directory.glob("*.tmp"):
        pid = tmp.suffixes[-2].lstrip(".") if len(tmp.suffixes) >= 2 else ""
        if not pid.isdigit() or not _alive(int(pid)):
            with contextlib.suppress(OSError):
                tmp.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def session(directory: Path, slot: dict[str, Any], key: dict[str, Any]) -> PackSession:
    """A :class:`PackSession` on the file for ``slot`` (what a load is: checkpoint, precision,
    rank; one file each, replaced when ``key`` changes), for the load's pack calls to go through."""
    name = hashlib.sha256(json.dumps(slot, sort_keys=True).encode()).hexdigest()[:24]
    return PackSession(directory / f"{name}.pack", {"slot": slot, **key})
