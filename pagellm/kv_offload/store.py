"""The offloading tier's storage: pages of KV kept under their prefix-cache keys, in host memory
(``HostKVStore``) or in a directory on disk that outlives the server (``DiskKVStore``).

Both keep an index of what they hold in least-recently-used order within a byte capacity, evict
from its cold end to make room, and report every key they drop (``take_removed``) so the scheduler
forgets it. Failures never raise while serving: a write that cannot complete returns False and a
read of anything missing, damaged or foreign returns None, each counted in ``KVTierStats``.

The disk tier's layout, under the server's own directory ``root``::

    root/<identity digest[:16]>/identity.json          what the entries were computed with (for people)
    root/<identity digest[:16]>/<key hex[:2]>/<key hex>.kv

Each ``.kv`` file is a header (magic, format version, lengths, the payload's CRC-32, the full
identity digest, the key, the header's own CRC-32) followed by the payload. Files are written to a
temporary name in the same directory and renamed into place, so a reader never sees half of one.
"""
from __future__ import annotations

import abc
import errno
import hashlib
import itertools
import json
import logging
import os
import stat
import struct
import threading
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any, Optional, Union

logger = logging.getLogger(__name__)

Payload = Union[bytes, bytearray, memoryview]

# Keys are the prefix cache's: a 32-byte SHA-256, with a group tag for multi-group caches. The
# bound keeps a key's hex file name under NAME_MAX (255).
MAX_KEY_BYTES = 64

_MAGIC = b"PGLMKVT\x00"
FORMAT_VERSION = 1
# magic, format version, key length, payload CRC-32, payload length; then the identity digest
# (32 bytes), the key, and the CRC-32 of everything before it in the header.
_FIXED = struct.Struct("<8sHHIQ")
_DIGEST_BYTES = 32
_CRC = struct.Struct("<I")
# A temporary file older than this belongs to no live write (one page takes milliseconds), even
# if its pid has been reused by another process since.
_STALE_TEMP_SECONDS = 600.0


def _checksum(data: Payload) -> int:
    # CRC-32 rather than BLAKE2b: the checksum guards against torn or bit-flipped files in a
    # directory only this server writes, not against an adversary (the header's identity digest
    # and key keep other configurations' entries out). Measured on 400 KB pages (AMD EPYC, one
    # core): zlib.crc32 96 us (4.3 GB/s) against hashlib.blake2b(digest_size=16) 439 us (0.93 GB/s).
    return zlib.crc32(data)


def header_size(key_len: int) -> int:
    """Bytes of a ``.kv`` file's header for a key of ``key_len`` bytes."""
    return _FIXED.size + _DIGEST_BYTES + key_len + _CRC.size


def identity_digest(identity: dict[str, Any]) -> bytes:
    """SHA-256 of the identity's canonical JSON (keys sorted) and the file format's version."""
    if not isinstance(identity, dict) or not identity:
        raise ValueError(f"a KV tier identity must be a non-empty dict, got {identity!r}")
    try:
        text = json.dumps(identity, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"a KV tier identity must be JSON-able (str keys; str, number, bool, list, dict values): {e}") from None
    return hashlib.sha256(f"pagellm-kv-tier-v{FORMAT_VERSION}\x00{text}".encode()).digest()


def check_key(key: bytes) -> None:
    if not isinstance(key, bytes) or not 0 < len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"a KV tier key is 1 to {MAX_KEY_BYTES} bytes, got {key!r:.80}")


def _byte_view(payload: Payload) -> memoryview:
    view = memoryview(payload)
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")  # a C-contiguous buffer of any item type, as flat bytes
    return view


@dataclass
class KVTierStats:
    """Cumulative counters of a store, and what it holds now."""

    num_entries: int = 0
    bytes_used: int = 0  # of stored entries (the disk tier: files, header included)
    capacity_bytes: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    num_writes: int = 0  # entries stored
    num_reads: int = 0  # read() calls: hits + misses
    num_read_hits: int = 0
    num_read_misses: int = 0  # absent, damaged or unreadable
    num_corrupt: int = 0  # damaged, truncated or foreign files found (and removed)
    num_write_errors: int = 0
    num_read_errors: int = 0  # I/O errors reading an entry the index held
    num_evictions: int = 0
    read_seconds: float = 0.0
    write_seconds: float = 0.0


@dataclass
class _Entry:
    size: int
    gen: int  # tells a stale handle from a rewrite of the same key
    data: Optional[bytes] = None  # the host tier's payload


class KVStore(abc.ABC):
    """A byte-capacity store of payloads under keys, least recently used evicted first.

    Thread-safe: one lock guards the index and counters; ``write`` and ``read`` may run on an
    I/O thread while the engine's thread calls ``keys``, ``contains``, ``take_removed`` and ``stats``.
    """

    def __init__(self, capacity_bytes: int) -> None:
        if not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be a positive int, got {capacity_bytes!r}")
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently used first
        self._pending: set[bytes] = set()  # keys being written
        self._reserved = 0  # bytes of writes in progress
        self._bytes_used = 0
        self._removed: list[bytes] = []
        self._gen = itertools.count()
        self._stats = KVTierStats(capacity_bytes=capacity_bytes)

    @property
    def capacity_bytes(self) -> int:
        return self._stats.capacity_bytes

    def keys(self) -> list[bytes]:
        """The keys held now, least recently used first."""
        with self._lock:
            return list(self._index)

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._index

    def take_removed(self) -> list[bytes]:
        """Keys dropped since the last call (evicted, failed writes, damaged entries)."""
        with self._lock:
            removed, self._removed = self._removed, []
            return removed

    @property
    def stats(self) -> KVTierStats:
        """A snapshot of the counters."""
        with self._lock:
            return replace(self._stats, num_entries=len(self._index), bytes_used=self._bytes_used)

    @abc.abstractmethod
    def write(self, key: bytes, payload: Payload) -> bool:
        """Store ``payload`` under ``key``; False (counted, the key reported removed) on any failure."""

    @abc.abstractmethod
    def read(self, key: bytes) -> Optional[bytes]:
        """The payload under ``key`` (now most recently used), or None on a miss or a bad entry."""

    def remove(self, key: bytes) -> None:
        """Drop ``key`` if held (not reported by ``take_removed``: the caller asked for it)."""
        check_key(key)
        with self._lock:
            entry = self._index.pop(key, None)
            if entry is not None:
                self._bytes_used -= entry.size
                self._discard(key, entry)

    # Under the lock, the subclasses' hooks and the shared bookkeeping.

    def _discard(self, key: bytes, entry: _Entry) -> None:  # noqa: B027 - the host tier's storage is the index entry itself
        """Release an entry's storage; called under the lock once it has left the index."""

    def _make_room(self, size: int) -> bool:
        """Evict least recently used entries until ``size`` more bytes fit; False if they never can."""
        if size > self._stats.capacity_bytes:
            return False
        while self._index and self._bytes_used + self._reserved + size > self._stats.capacity_bytes:
            key, entry = self._index.popitem(last=False)
            self._bytes_used -= entry.size
            self._stats.num_evictions += 1
            self._removed.append(key)
            self._discard(key, entry)
        # Writes in flight may hold the rest; this one fails rather than waits.
        return self._bytes_used + self._reserved + size <= self._stats.capacity_bytes

    def _drop(self, key: bytes, gen: int) -> None:
        """Forget a bad entry, unless it has been rewritten meanwhile."""
        entry = self._index.get(key)
        if entry is not None and entry.gen == gen:
            del self._index[key]
            self._bytes_used -= entry.size
            self._removed.append(key)
            self._discard(key, entry)


class HostKVStore(KVStore):
    """Pages in this process's memory (the GPU path's host tier); lost when the server stops."""

    def write(self, key: bytes, payload: Payload) -> bool:
        check_key(key)
        start = time.perf_counter()
        if self._touch(key):
            return True
        data = _byte_view(payload).tobytes()  # the copy, outside the lock
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                return True
            if not self._make_room(len(data)):
                self._stats.num_write_errors += 1
                self._removed.append(key)
                return False
            self._index[key] = _Entry(len(data), next(self._gen), data)
            self._bytes_used += len(data)
            self._stats.num_writes += 1
            self._stats.bytes_written += len(data)
            self._stats.write_seconds += time.perf_counter() - start
        return True

    def _touch(self, key: bytes) -> bool:
        """Mark ``key`` recently used; False if not held."""
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                return True
        return False

    def read(self, key: bytes) -> Optional[bytes]:
        check_key(key)
        start = time.perf_counter()
        with self._lock:
            self._stats.num_reads += 1
            entry = self._index.get(key)
            if entry is None:
                self._stats.num_read_misses += 1
                return None
            self._index.move_to_end(key)
            self._stats.num_read_hits += 1
            self._stats.bytes_read += entry.size
            self._stats.read_seconds += time.perf_counter() - start
            return entry.data


class _Corrupt(Exception):
    """A file that is not a whole, intact entry of this store's identity and key."""


def _check_private_dir(path: str) -> None:
    """Create ``path`` (mode 0700) if absent; refuse one that another user could tamper with."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)
        except OSError as e:
            raise ValueError(f"cannot create the KV tier directory {path!r}: {e}") from None
        st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise ValueError(f"the KV tier directory {path!r} is a symlink; give the real path")
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"the KV tier directory {path!r} exists and is not a directory")
    if st.st_uid != os.geteuid():
        raise ValueError(f"the KV tier directory {path!r} is owned by uid {st.st_uid}, not this server's ({os.geteuid()})")
    if st.st_mode & 0o022:
        raise ValueError(
            f"the KV tier directory {path!r} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}); "
            "chmod it to 0700 or give another directory"
        )


class DiskKVStore(KVStore):
    """Pages as files under ``root_dir``, kept across restarts for the same ``identity``.

    ``identity`` is every setting that shapes a page's bytes (model file, dtypes, block size, TP
    size and rank, layer and head shapes, ...): stores of different identities share a root but
    never read each other's entries. One server process per identity and root: the index lives in
    the process, so two live stores on one directory would each count the other's files as absent.
    """

    def __init__(self, root_dir: str, identity: dict[str, Any], capacity_bytes: int, fsync: bool = True) -> None:
        super().__init__(capacity_bytes)
        self._digest = identity_digest(identity)
        self.root = os.path.abspath(root_dir)
        _check_private_dir(self.root)
        self.dir = os.path.join(self.root, self._digest.hex()[:16])
        _check_private_dir(self.dir)
        self._fsync = fsync
        self._tmp_counter = itertools.count()
        self._clock = 0  # the last mtime given, in ns: strictly increasing, so LRU order survives
        self._logged_errors: set[tuple[str, int]] = set()
        self._write_identity(identity)
        self._scan()

    def path_of(self, key: bytes) -> str:
        name = key.hex()
        return os.path.join(self.dir, name[:2], name + ".kv")

    def write(self, key: bytes, payload: Payload) -> bool:
        check_key(key)
        start = time.perf_counter()
        view = _byte_view(payload)
        header = self._header(key, _checksum(view), view.nbytes)
        size = len(header) + view.nbytes
        with self._lock:
            if key in self._index or key in self._pending:
                if key in self._index:
                    self._index.move_to_end(key)
                return True
            if not self._make_room(size):
                self._stats.num_write_errors += 1
                self._removed.append(key)
                return False
            self._reserved += size
            self._pending.add(key)
            mtime = self._tick()
        ok = self._write_file(key, header, view, mtime)
        with self._lock:
            self._reserved -= size
            self._pending.discard(key)
            if ok:
                self._index[key] = _Entry(size, next(self._gen))
                self._bytes_used += size
                self._stats.num_writes += 1
                self._stats.bytes_written += size
            else:
                self._stats.num_write_errors += 1
                self._removed.append(key)
            self._stats.write_seconds += time.perf_counter() - start
        return ok

    def read(self, key: bytes) -> Optional[bytes]:
        check_key(key)
        start = time.perf_counter()
        with self._lock:
            self._stats.num_reads += 1
            entry = self._index.get(key)
            if entry is None:
                self._stats.num_read_misses += 1
                return None
            gen = entry.gen
        path = self.path_of(key)
        try:
            payload = self._read_file(path, key)
        except _Corrupt as e:
            logger.warning("KV tier: dropping damaged entry %s: %s", path, e)
            with self._lock:
                self._stats.num_corrupt += 1
                self._stats.num_read_misses += 1
                self._drop(key, gen)
            return None
        except OSError as e:
            with self._lock:
                entry = self._index.get(key)
                if isinstance(e, FileNotFoundError) and (entry is None or entry.gen != gen):
                    self._stats.num_read_misses += 1  # evicted or rewritten by another thread meanwhile: a plain miss
                    return None
            # Gone (deleted behind our back) or unreadable: either way the scheduler should stop
            # counting on it, so it leaves the index as a damaged entry does.
            self._log_error("read", e)
            with self._lock:
                self._stats.num_read_errors += 1
                self._stats.num_read_misses += 1
                self._drop(key, gen)
            return None
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
            mtime = self._tick()
            self._stats.num_read_hits += 1
            self._stats.bytes_read += header_size(len(key)) + len(payload)
            self._stats.read_seconds += time.perf_counter() - start
        try:
            os.utime(path, ns=(mtime, mtime))  # the LRU order a restart will find
        except OSError:
            pass  # evicted meanwhile, or the directory turned read-only: the payload is good anyway
        return payload

    # Files.

    def _header(self, key: bytes, crc: int, payload_len: int) -> bytes:
        head = _FIXED.pack(_MAGIC, FORMAT_VERSION, len(key), crc, payload_len) + self._digest + key
        return head + _CRC.pack(zlib.crc32(head))

    def _parse_header(self, head: bytes, key: bytes) -> tuple[int, int]:
        """(payload CRC, payload length) of a header that must be this store's, for ``key``."""
        if len(head) != header_size(len(key)):
            raise _Corrupt(f"header truncated ({len(head)} bytes)")
        magic, version, key_len, crc, payload_len = _FIXED.unpack_from(head)
        if magic != _MAGIC:
            raise _Corrupt("not a KV tier file (bad magic)")
        if version != FORMAT_VERSION:
            raise _Corrupt(f"format version {version}, expected {FORMAT_VERSION}")
        (head_crc,) = _CRC.unpack_from(head, len(head) - _CRC.size)
        if zlib.crc32(head[: -_CRC.size]) != head_crc:
            raise _Corrupt("header checksum mismatch")
        if key_len != len(key) or head[_FIXED.size + _DIGEST_BYTES : -_CRC.size] != key:
            raise _Corrupt("written under another key")
        if head[_FIXED.size : _FIXED.size + _DIGEST_BYTES] != self._digest:
            raise _Corrupt("written for another identity (model or configuration)")
        return crc, payload_len

    def _read_file(self, path: str, key: bytes) -> bytes:
        with open(path, "rb", buffering=0) as f:
            file_size = os.fstat(f.fileno()).st_size
            hsize = header_size(len(key))
            crc, payload_len = self._parse_header(f.read(hsize), key)
            if file_size != hsize + payload_len:
                raise _Corrupt(f"{file_size} bytes, the header says {hsize + payload_len}")
            payload = f.read(payload_len)
        if len(payload) != payload_len:
            raise _Corrupt(f"payload truncated ({len(payload)} of {payload_len} bytes)")
        if _checksum(payload) != crc:
            raise _Corrupt("payload checksum mismatch")
        return payload

    def _write_file(self, key: bytes, header: bytes, payload: memoryview, mtime: int) -> bool:
        path = self.path_of(key)
        directory = os.path.dirname(path)
        tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.{next(self._tmp_counter)}.tmp")
        fd = -1
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
            try:
                fd = os.open(tmp, flags, 0o600)
            except FileNotFoundError:  # the key's first in its subdirectory (or it was removed behind our back)
                os.makedirs(directory, mode=0o700, exist_ok=True)
                fd = os.open(tmp, flags, 0o600)
            _write_all(fd, header)
            _write_all(fd, payload)
            if self._fsync:
                os.fsync(fd)
            os.utime(fd, ns=(mtime, mtime))
            os.close(fd)
            fd = -1
            # The rename publishes the file whole. The directory is not fsynced: after a power cut
            # the entry may be missing (a miss), never torn.
            os.replace(tmp, path)
            return True
        except OSError as e:
            self._log_error("write", e)
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass  # the write already failed; the temp file goes below
            try:
                os.unlink(tmp)
            except OSError:
                pass  # never created, or the directory forbids it: a restart's scan removes it
            return False

    def _discard(self, key: bytes, entry: _Entry) -> None:
        try:
            os.unlink(self.path_of(key))
        except OSError as e:
            # Already gone, or the directory turned read-only: the index forgets it either way and
            # a restart's scan finds any leftover (whole and checked) again.
            if not isinstance(e, FileNotFoundError):
                self._log_error("remove", e)

    def _tick(self) -> int:
        self._clock = max(time.time_ns(), self._clock + 1)
        return self._clock

    def _log_error(self, op: str, e: OSError) -> None:
        # A full disk fails every write: say so once per kind of failure, not once per page.
        level = logging.DEBUG if (op, e.errno or 0) in self._logged_errors else logging.WARNING
        self._logged_errors.add((op, e.errno or 0))
        logger.log(level, "KV tier %s failed under %s (serving goes on without it): %s", op, self.dir, e)

    def _write_identity(self, identity: dict[str, Any]) -> None:
        path = os.path.join(self.dir, "identity.json")
        if os.path.exists(path):
            return
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600), "w", encoding="utf-8") as f:
                json.dump({"format_version": FORMAT_VERSION, "identity": identity}, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except OSError as e:
            self._log_error("write identity.json", e)  # informational only: the digest in each header is what counts

    def _scan(self) -> None:
        """Rebuild the index from this identity's files, reading headers only.

        Temporary files of dead writers (a crash mid-write) are deleted; damaged or foreign
        ``.kv`` files are deleted and counted; anything else is left alone and never read.
        """
        found: list[tuple[int, str, bytes, int]] = []
        now = time.time()
        try:
            subdirs = [e for e in os.scandir(self.dir) if e.is_dir(follow_symlinks=False)]
        except OSError as e:
            self._log_error("scan", e)
            return
        for sub in subdirs:
            try:
                entries = list(os.scandir(sub.path))
            except OSError as e:
                self._log_error("scan", e)
                continue
            for ent in entries:
                name = ent.name
                try:
                    if not ent.is_file(follow_symlinks=False):
                        continue
                    if name.endswith(".tmp"):
                        if _temp_is_dead(name, ent.stat(follow_symlinks=False).st_mtime, now):
                            os.unlink(ent.path)
                        continue
                    if not name.endswith(".kv"):
                        continue
                    try:
                        key = bytes.fromhex(name[:-3])
                    except ValueError:
                        continue  # not a name this store writes
                    if not 0 < len(key) <= MAX_KEY_BYTES or name[:-3] != key.hex() or sub.name != name[:2]:
                        continue  # not where this store would have put that key
                    st = ent.stat(follow_symlinks=False)
                    try:
                        with open(ent.path, "rb", buffering=0) as f:
                            _, payload_len = self._parse_header(f.read(header_size(len(key))), key)
                        if st.st_size != header_size(len(key)) + payload_len:
                            raise _Corrupt(f"{st.st_size} bytes, the header says {header_size(len(key)) + payload_len}")
                    except _Corrupt as e:
                        logger.warning("KV tier: removing damaged entry %s found at start-up: %s", ent.path, e)
                        self._stats.num_corrupt += 1
                        os.unlink(ent.path)
                        continue
                    found.append((st.st_mtime_ns, name, key, st.st_size))
                except OSError as e:
                    self._log_error("scan", e)
        found.sort()
        for mtime, _, key, size in found:
            self._index[key] = _Entry(size, next(self._gen))
            self._bytes_used += size
            self._clock = max(self._clock, mtime)
        if found:
            logger.info("KV tier: %d entries (%.1f MiB) found under %s", len(found), self._bytes_used / 2**20, self.dir)
        with self._lock:
            self._make_room(0)  # the capacity may have shrunk since the files were written
            self._removed.clear()  # the scheduler learns the keys from keys(); it never knew these


def _write_all(fd: int, data: Payload) -> None:
    view = memoryview(data)
    while view.nbytes:
        n = os.write(fd, view)
        if n <= 0:
            raise OSError(errno.ENOSPC, "short write")  # nothing more fits
        view = view[n:]


def _temp_is_dead(name: str, mtime: float, now: float) -> bool:
    """A temporary file ``.<file>.<pid>.<n>.tmp`` whose writer is gone (or is long stale)."""
    if now - mtime > _STALE_TEMP_SECONDS:
        return True
    try:
        pid = int(name.split(".")[-3])
    except (ValueError, IndexError):
        return True
    if pid == os.getpid():
        return False  # another store of this process, writing now
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False  # alive, another user's
    return False
