"""The offloading tier's stores: exact contents, LRU order within capacity, restarts, and every fault
giving a miss or False with its counter, never an exception."""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest

from pagellm.kv_offload import store as store_mod
from pagellm.kv_offload.store import DiskKVStore, HostKVStore, KVStore, header_size

REPO = Path(__file__).resolve().parents[2]
IDENTITY = {"model": "smollm2-135m.gguf:1234:5678", "dtype": "bfloat16", "kv_dtype": "bfloat16", "block_size": 16, "tp": [1, 0], "v": 1}
OTHER = dict(IDENTITY, model="llama-3.1-8b.gguf:99:1")


def key(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def payload(i: int, n: int = 4096) -> bytes:
    return hashlib.sha256(f"p{i}".encode()).digest() * (n // 32)


def disk(tmp_path: Path, capacity: int = 10**9, identity: dict = IDENTITY, **kw) -> DiskKVStore:
    return DiskKVStore(str(tmp_path / "tier"), identity, capacity, **kw)


def files(s: DiskKVStore) -> list[str]:
    return sorted(str(p.relative_to(s.dir)) for p in Path(s.dir).rglob("*") if p.is_file() and p.name != "identity.json")


@pytest.fixture(params=["host", "disk"])
def any_store(request, tmp_path) -> KVStore:
    return HostKVStore(10**9) if request.param == "host" else disk(tmp_path, fsync=False)


def entry_size(s: KVStore, n: int) -> int:
    return n + (header_size(32) if isinstance(s, DiskKVStore) else 0)


# Round trips and LRU.


def test_round_trip_bytes_equal(any_store):
    data = [payload(i, 4096 + 32 * i) for i in range(5)]
    for i, d in enumerate(data):
        assert any_store.write(key(i), memoryview(d) if i % 2 else d)
    assert any_store.keys() == [key(i) for i in range(5)]
    for i, d in enumerate(data):
        assert any_store.contains(key(i))
        assert any_store.read(key(i)) == d
    assert not any_store.contains(key(99)) and any_store.read(key(99)) is None
    st = any_store.stats
    assert (st.num_entries, st.num_writes, st.num_reads, st.num_read_hits, st.num_read_misses) == (5, 5, 6, 5, 1)
    assert st.bytes_used == st.bytes_written == sum(entry_size(any_store, len(d)) for d in data)
    assert st.bytes_read == st.bytes_used
    assert (st.num_corrupt, st.num_write_errors, st.num_read_errors, st.num_evictions) == (0, 0, 0, 0)
    assert any_store.take_removed() == []


def test_write_takes_any_contiguous_buffer(any_store):
    import numpy as np

    arr = np.arange(1024, dtype=np.float32)
    assert any_store.write(key(0), memoryview(arr))
    assert any_store.read(key(0)) == arr.tobytes()


def test_rewrite_of_a_held_key_only_marks_it_used(any_store):
    for i in range(3):
        any_store.write(key(i), payload(i))
    assert any_store.write(key(0), payload(0))
    assert any_store.keys() == [key(1), key(2), key(0)]
    assert any_store.stats.num_writes == 3


def test_read_marks_recently_used_and_capacity_evicts_lru_first(any_store):
    size = entry_size(any_store, 4096)
    any_store._stats.capacity_bytes = 3 * size  # the fixture's store, narrowed to three entries
    for i in range(3):
        assert any_store.write(key(i), payload(i))
    assert any_store.read(key(0)) == payload(0)
    assert any_store.keys() == [key(1), key(2), key(0)]
    assert any_store.write(key(3), payload(3))
    assert any_store.keys() == [key(2), key(0), key(3)]
    assert any_store.write(key(4), payload(4))
    assert any_store.keys() == [key(0), key(3), key(4)]
    assert any_store.take_removed() == [key(1), key(2)]
    assert any_store.take_removed() == []
    st = any_store.stats
    assert (st.num_evictions, st.num_entries, st.bytes_used) == (2, 3, 3 * size)
    if isinstance(any_store, DiskKVStore):
        assert files(any_store) == sorted(os.path.relpath(any_store.path_of(key(i)), any_store.dir) for i in (0, 3, 4))


def test_payload_over_capacity_fails_and_keeps_the_rest(any_store):
    any_store._stats.capacity_bytes = 2 * entry_size(any_store, 4096)
    assert any_store.write(key(0), payload(0))
    assert not any_store.write(key(1), payload(1, 3 * 4096))
    assert any_store.keys() == [key(0)]
    assert any_store.take_removed() == [key(1)]
    assert any_store.stats.num_write_errors == 1 and any_store.stats.num_evictions == 0


def test_remove(any_store):
    any_store.write(key(0), payload(0))
    any_store.remove(key(0))
    any_store.remove(key(1))
    assert any_store.keys() == [] and any_store.read(key(0)) is None
    assert any_store.stats.bytes_used == 0 and any_store.take_removed() == []
    if isinstance(any_store, DiskKVStore):
        assert files(any_store) == []


def test_bad_input_raises_value_error(tmp_path):
    for bad in ("abc", b"", b"x" * 65, None):
        with pytest.raises(ValueError, match="key"):
            HostKVStore(100).write(bad, b"x")
    with pytest.raises(ValueError, match="capacity_bytes"):
        HostKVStore(0)
    with pytest.raises(ValueError, match="JSON-able"):
        disk(tmp_path, identity={"dtype": object()})
    with pytest.raises(ValueError, match="non-empty dict"):
        disk(tmp_path, identity={})


# Disk layout and restarts.


def test_layout_and_file_mode(tmp_path):
    s = disk(tmp_path)
    s.write(key(7), payload(7))
    digest = store_mod.identity_digest(IDENTITY).hex()
    h = key(7).hex()
    path = tmp_path / "tier" / digest[:16] / h[:2] / f"{h}.kv"
    assert s.path_of(key(7)) == str(path) and path.is_file()
    assert path.stat().st_mode & 0o777 == 0o600
    for d in (tmp_path / "tier", path.parent.parent, path.parent):
        assert d.stat().st_mode & 0o777 == 0o700
    assert path.stat().st_size == header_size(32) + 4096
    assert json.loads((path.parent.parent / "identity.json").read_text())["identity"] == IDENTITY


def test_restart_finds_keys_in_lru_order(tmp_path):
    s = disk(tmp_path)
    for i in range(6):
        s.write(key(i), payload(i))
    s.read(key(1))
    s.read(key(4))
    s.read(key(1))
    order = [key(i) for i in (0, 2, 3, 5, 4, 1)]
    assert s.keys() == order
    s2 = disk(tmp_path)
    assert s2.keys() == order
    assert s2.stats.num_entries == 6 and s2.stats.bytes_used == s.stats.bytes_used
    assert s2.stats.num_reads == 0  # the scan reads headers, no payloads
    for i in range(6):
        assert s2.read(key(i)) == payload(i)
    # Reads after the restart move keys on from where the last run left them.
    assert disk(tmp_path).keys() == [key(i) for i in range(6)]


def test_restart_with_smaller_capacity_evicts_lru(tmp_path):
    s = disk(tmp_path)
    for i in range(4):
        s.write(key(i), payload(i))
    s2 = disk(tmp_path, capacity=2 * (header_size(32) + 4096))
    assert s2.keys() == [key(2), key(3)]
    assert s2.take_removed() == [] and s2.stats.num_evictions == 2
    assert len(files(s2)) == 2


def test_another_identity_sees_nothing_and_leaves_it(tmp_path):
    a = disk(tmp_path)
    a.write(key(0), payload(0))
    b = disk(tmp_path, identity=OTHER)
    assert b.dir != a.dir and b.keys() == [] and b.read(key(0)) is None
    b.write(key(1), payload(1))
    assert disk(tmp_path).keys() == [key(0)] and disk(tmp_path, identity=OTHER).keys() == [key(1)]
    # An identity's digest covers every field, whatever the dict's order.
    assert disk(tmp_path, identity=dict(reversed(list(IDENTITY.items())))).keys() == [key(0)]


def test_scan_removes_temps_of_dead_writers_and_ignores_foreign_names(tmp_path):
    s = disk(tmp_path)
    s.write(key(0), payload(0))
    sub = Path(s.path_of(key(0))).parent
    dead = _dead_pid()
    (sub / f".{key(0).hex()}.kv.{dead}.0.tmp").write_bytes(b"half")
    live = sub / f".{key(1).hex()}.kv.{os.getppid()}.0.tmp"  # a live writer's (another process)
    live.write_bytes(b"half")
    stale = sub / f".{key(2).hex()}.kv.{os.getppid()}.1.tmp"
    stale.write_bytes(b"old")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    (sub / "README").write_text("not ours")
    (sub / "zz.kv").write_text("not a hex key name")
    shutil.copy(s.path_of(key(0)), sub / f"{key(0).hex().upper()}.kv")  # not a name this store writes
    s2 = disk(tmp_path)
    assert s2.keys() == [key(0)]
    left = sorted(p.name for p in sub.iterdir())
    assert left == sorted([f"{key(0).hex()}.kv", live.name, "README", "zz.kv", f"{key(0).hex().upper()}.kv"])


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


# Faults: each a miss or False with its counter.


def _assert_dropped_as_corrupt(s: DiskKVStore, k: bytes) -> None:
    assert s.read(k) is None
    st = s.stats
    assert (st.num_corrupt, st.num_read_misses, st.num_read_hits) == (1, 1, 0)
    assert not s.contains(k) and not os.path.exists(s.path_of(k))
    assert s.take_removed() == [k]
    assert st.bytes_used == 0 and st.num_entries == 0


def test_truncated_file(tmp_path):
    s = disk(tmp_path)
    s.write(key(0), payload(0))
    os.truncate(s.path_of(key(0)), header_size(32) + 100)
    _assert_dropped_as_corrupt(s, key(0))


def test_truncated_header(tmp_path):
    s = disk(tmp_path)
    s.write(key(0), payload(0))
    os.truncate(s.path_of(key(0)), 10)
    _assert_dropped_as_corrupt(s, key(0))


@pytest.mark.parametrize("where", ["payload_first", "payload_last", "magic", "version", "crc", "length", "digest", "key", "header_crc"])
def test_flipped_byte(tmp_path, where):
    s = disk(tmp_path)
    s.write(key(0), payload(0))
    offset = {
        "magic": 0, "version": 8, "crc": 12, "length": 16, "digest": 30, "key": 24 + 32 + 5, "header_crc": header_size(32) - 1,
        "payload_first": header_size(32), "payload_last": header_size(32) + 4095,
    }[where]  # fmt: skip
    path = s.path_of(key(0))
    data = bytearray(Path(path).read_bytes())
    data[offset] ^= 0x01
    Path(path).write_bytes(data)
    _assert_dropped_as_corrupt(s, key(0))


def test_another_models_file_copied_in_is_never_read(tmp_path):
    a, b = disk(tmp_path), disk(tmp_path, identity=OTHER)
    a.write(key(0), payload(0))
    b.write(key(0), payload(100))
    b.write(key(1), payload(101))
    # Over one of ours: the read finds another identity's digest.
    shutil.copy(b.path_of(key(0)), a.path_of(key(0)))
    _assert_dropped_as_corrupt(a, key(0))
    # Under a name of its own: a restart's scan removes it without reading its payload.
    os.makedirs(os.path.dirname(a.path_of(key(1))), exist_ok=True)
    shutil.copy(b.path_of(key(1)), a.path_of(key(1)))
    a2 = disk(tmp_path)
    assert a2.keys() == [] and a2.stats.num_corrupt == 1 and not os.path.exists(a2.path_of(key(1)))
    assert a2.read(key(1)) is None
    # A file renamed to another key's name is refused too.
    a2.write(key(2), payload(2))
    os.makedirs(os.path.dirname(a2.path_of(key(3))), exist_ok=True)
    os.replace(a2.path_of(key(2)), a2.path_of(key(3)))
    a3 = disk(tmp_path)
    assert a3.keys() == [] and a3.stats.num_corrupt == 1
    assert b.read(key(0)) == payload(100)  # the other model's own entries are untouched


def test_subdirectory_removed_behind_the_stores_back(tmp_path):
    s = disk(tmp_path)
    s.write(key(0), payload(0))
    shutil.rmtree(os.path.dirname(s.path_of(key(0))))
    k = next(key(i) for i in range(1, 1000) if key(i).hex()[:2] == key(0).hex()[:2])
    assert s.write(k, payload(1)) and s.read(k) == payload(1)  # made again
    assert s.read(key(0)) is None and s.stats.num_read_errors == 1


def test_file_deleted_behind_the_stores_back_is_a_read_error(tmp_path):
    s = disk(tmp_path)
    s.write(key(0), payload(0))
    os.unlink(s.path_of(key(0)))
    assert s.read(key(0)) is None
    st = s.stats
    assert (st.num_read_errors, st.num_read_misses, st.num_corrupt, st.num_entries) == (1, 1, 0, 0)
    assert s.take_removed() == [key(0)]


def _temps(s: DiskKVStore) -> list[str]:
    return [f for f in files(s) if f.endswith(".tmp")]


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EIO])
def test_write_error_returns_false(tmp_path, monkeypatch, err):
    s = disk(tmp_path)
    assert s.write(key(0), payload(0))
    real_write = os.write
    calls = []

    def failing_write(fd, data):
        calls.append(len(data))
        if len(calls) == 2:  # after the header: a temp file with part of a page in it
            raise OSError(err, os.strerror(err))
        return real_write(fd, data)

    monkeypatch.setattr(store_mod.os, "write", failing_write)
    assert s.write(key(1), payload(1)) is False
    monkeypatch.undo()
    st = s.stats
    assert (st.num_write_errors, st.num_writes, st.num_entries) == (1, 1, 1)
    assert s.keys() == [key(0)] and s.take_removed() == [key(1)]
    assert _temps(s) == [] and not os.path.exists(s.path_of(key(1)))
    assert s.write(key(1), payload(1)) and s.read(key(1)) == payload(1)  # serving goes on once the disk has room


def test_real_file_size_limit_in_a_subprocess(tmp_path):
    # RLIMIT_FSIZE makes the kernel refuse the write (EFBIG, with SIGXFSZ ignored): a real failure
    # partway through a file, as a full disk gives, without needing root to make a small filesystem.
    script = textwrap.dedent(
        f"""
        import json, resource, signal, sys
        sys.path.insert(0, {str(REPO)!r})
        from pagellm.kv_offload.store import DiskKVStore
        s = DiskKVStore({str(tmp_path / "tier")!r}, {IDENTITY!r}, 10**9)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
        small = s.write(b"a" * 32, b"x" * 1000)
        big = s.write(b"b" * 32, b"y" * 200_000)
        st = s.stats
        print(json.dumps([small, big, st.num_write_errors, st.num_entries, [k.hex() for k in s.take_removed()]]))
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    small, big, errors, entries, removed = json.loads(out.stdout.strip().splitlines()[-1])
    assert (small, big, errors, entries, removed) == (True, False, 1, 1, [(b"b" * 32).hex()])
    s = disk(tmp_path)
    assert s.keys() == [b"a" * 32] and _temps(s) == []


def _writable_despite_mode(path: Path) -> bool:
    probe = path / "probe"
    try:
        probe.write_bytes(b"")
    except PermissionError:
        return False
    probe.unlink()
    return True


def test_read_only_directory(tmp_path):
    s = disk(tmp_path)
    s.write(key(0), payload(0))
    os.chmod(s.dir, 0o500)
    os.chmod(os.path.dirname(s.path_of(key(0))), 0o500)
    try:
        if _writable_despite_mode(Path(s.dir)):
            pytest.skip("running as root: a 0500 directory stays writable (the forked non-root test covers it)")
        _check_read_only(s)
    finally:
        os.chmod(os.path.dirname(s.path_of(key(0))), 0o700)
        os.chmod(s.dir, 0o700)


def _check_read_only(s: DiskKVStore) -> None:
    assert s.write(key(1), payload(1)) is False  # a new subdirectory
    k = next(key(i) for i in range(2, 1000) if key(i).hex()[:2] == key(0).hex()[:2])
    assert s.write(k, payload(1)) is False  # the existing, read-only subdirectory
    assert s.read(key(0)) == payload(0)  # what is there still serves (its mtime not updated)
    st = s.stats
    assert (st.num_write_errors, st.num_entries, st.num_read_hits) == (2, 1, 1)
    assert s.take_removed() == [key(1), k]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop to another user")
def test_read_only_directory_as_a_non_root_user():
    # Root ignores directory modes, so the real EACCES comes from a forked child that drops to nobody.
    root = Path(tempfile.mkdtemp(prefix="pagellm-kvtier-ro-"))
    try:
        os.chown(root, 65534, 65534)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: plain os calls only, then _exit
            code = 1
            try:
                os.close(r)
                os.setgid(65534)
                os.setuid(65534)
                s = DiskKVStore(str(root / "tier"), IDENTITY, 10**9)
                s.write(key(0), payload(0))
                os.chmod(s.dir, 0o500)
                os.chmod(os.path.dirname(s.path_of(key(0))), 0o500)
                _check_read_only(s)
                code = 0
            except BaseException as e:  # noqa: BLE001 - reported through the pipe; the child must reach _exit
                os.write(w, repr(e).encode())
            finally:
                os._exit(code)
        os.close(w)
        _, status = os.waitpid(pid, 0)
        msg = os.read(r, 4096).decode()
        os.close(r)
        assert os.waitstatus_to_exitcode(status) == 0, msg
    finally:
        subprocess.run(["chmod", "-R", "u+rwx", str(root)], check=False)
        shutil.rmtree(root)


def test_killed_mid_write_leaves_nothing_readable(tmp_path):
    # The writer stops between its last byte and the rename (os.replace sleeps), and is SIGKILLed there.
    big = 8 * 2**20
    script = textwrap.dedent(
        f"""
        import os, sys, time
        sys.path.insert(0, {str(REPO)!r})
        from pagellm.kv_offload import store
        s = store.DiskKVStore({str(tmp_path / "tier")!r}, {IDENTITY!r}, 10**9)
        s.write(b"a" * 32, b"x" * 1000)
        def stuck(src, dst):
            print("READY", src, flush=True)
            time.sleep(60)
        store.os.replace = stuck
        s.write(b"b" * 32, b"y" * {big})
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("READY"), proc.stderr.read()
        tmp = Path(line.split()[1])
        assert tmp.stat().st_size == header_size(32) + big  # whole, but never published
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    s = disk(tmp_path)
    assert s.keys() == [b"a" * 32]
    assert not tmp.exists() and _temps(s) == []
    assert s.read(b"b" * 32) is None and s.read(b"a" * 32) == b"x" * 1000


# The root directory must be the server's own.


def test_creates_a_missing_root_0700(tmp_path):
    s = DiskKVStore(str(tmp_path / "a" / "b"), IDENTITY, 1000)
    assert os.stat(s.root).st_mode & 0o777 == 0o700 and os.stat(s.dir).st_mode & 0o777 == 0o700


def test_refuses_a_symlink_root(tmp_path):
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(ValueError, match="symlink"):
        DiskKVStore(str(tmp_path / "link"), IDENTITY, 1000)


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o770, 0o702])
def test_refuses_a_root_others_can_write(tmp_path, mode):
    root = tmp_path / "tier"
    root.mkdir()
    os.chmod(root, mode)
    with pytest.raises(ValueError, match="writable by group or others"):
        DiskKVStore(str(root), IDENTITY, 1000)


def test_refuses_a_root_that_is_a_file(tmp_path):
    (tmp_path / "tier").write_text("")
    with pytest.raises(ValueError, match="not a directory"):
        DiskKVStore(str(tmp_path / "tier"), IDENTITY, 1000)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another user")
def test_refuses_a_root_owned_by_another_user(tmp_path):
    root = tmp_path / "tier"
    root.mkdir(mode=0o700)
    os.chown(root, 65534, 65534)
    with pytest.raises(ValueError, match="owned by uid 65534"):
        DiskKVStore(str(root), IDENTITY, 1000)


def test_refuses_a_tampered_identity_directory(tmp_path):
    s = disk(tmp_path)
    os.chmod(s.dir, 0o777)
    with pytest.raises(ValueError, match="writable by group or others"):
        disk(tmp_path)


# Threads: the I/O thread writes and reads while the engine's thread asks.


def test_concurrent_writes_reads_and_queries_stay_consistent(tmp_path):
    s = disk(tmp_path, capacity=20 * (header_size(32) + 4096), fsync=False)
    stop = threading.Event()
    bad: list[str] = []

    def writer() -> None:
        for i in range(300):
            s.write(key(i), payload(i))
        stop.set()

    def reader() -> None:
        while not stop.is_set():
            for k in s.keys()[-5:]:
                got = s.read(k)
                i = next(j for j in range(300) if key(j) == k)
                if got is not None and got != payload(i):
                    bad.append(k.hex())

    threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
    for t in threads:
        t.start()
    removed = []
    while not stop.is_set():
        s.contains(key(0))
        assert s.stats.bytes_used <= s.stats.capacity_bytes
        removed += s.take_removed()
    for t in threads:
        t.join()
    removed += s.take_removed()
    assert bad == []
    st = s.stats
    assert st.num_entries == 20 and st.bytes_used == 20 * (header_size(32) + 4096)
    assert sorted(removed) == sorted(key(i) for i in range(300) if key(i) not in set(s.keys()))
    assert st.num_corrupt == 0 and st.num_read_errors == 0
    assert len(files(s)) == 20


def test_fsync_is_used_when_asked(tmp_path, monkeypatch):
    synced = []
    real = os.fsync
    monkeypatch.setattr(store_mod.os, "fsync", lambda fd: synced.append(fd) or real(fd))
    disk(tmp_path).write(key(0), payload(0))
    assert len(synced) == 1
    disk(tmp_path, fsync=False).write(key(1), payload(1))
    assert len(synced) == 1
