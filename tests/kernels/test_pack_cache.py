"""Packed weights kept on disk: recorded by one load, mapped (not packed) by the next of the same key."""
from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path

import pytest
import torch

from pagellm.kernels import pack_cache
from pagellm.kernels.context import KernelContext

SLOT = {"checkpoint": "/models/m.gguf", "precision": ["int8", "bfloat16"], "dtype": "torch.float32", "tp": [0, 1]}
KEY = {"files": [["m.gguf", 123, 456, 789]], "code": "abc", "kernels": "build"}


def mapped_from(tensor: torch.Tensor, path: Path) -> bool:
    """Whether ``tensor``'s bytes lie in a mapping of ``path`` (/proc/self/maps)."""
    address = tensor.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].strip() == str(path):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                if start <= address < end:
                    return True
    return False


class Packer:
    """Pack functions that count their calls; each call's panels differ (its index in the values)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
        self.calls += 1
        return (torch.arange(shape[0] * shape[1]) * self.calls).reshape(shape).to(dtype)


Shapes = list[tuple[list[int], torch.dtype]]


def load(directory: Path, packer: Packer, shapes: Shapes, key: dict = KEY) -> tuple[pack_cache.PackSession, list[torch.Tensor]]:
    """One 'load': a pack call per shape through a session, then its file written (and waited for)."""
    kernels = KernelContext()
    session = pack_cache.session(directory, SLOT, key)
    with kernels.packing(session):
        tensors = [kernels.pack("p", [shape, str(dtype)], lambda s=shape, d=dtype: packer(s, d)) for shape, dtype in shapes]
    assert kernels.pack_session is None  # only during the load
    session.finish()
    pack_cache.wait_for_writes()
    return session, tensors


SHAPES = [([32, 100], torch.uint8), ([16, 64], torch.bfloat16), ([8, 33], torch.float32)]


def test_a_second_load_maps_what_the_first_packed(tmp_path: Path) -> None:
    first_packer, second_packer = Packer(), Packer()
    first, packed = load(tmp_path, first_packer, SHAPES)
    assert first_packer.calls == 3 and not first.complete
    [path] = tmp_path.glob("*.pack")
    assert path == first.path
    inode = path.stat().st_ino
    second, mapped = load(tmp_path, second_packer, SHAPES)
    assert second.complete and second_packer.calls == 0
    assert second.mapped_bytes == sum(t.nbytes for t in packed)
    for want, got in zip(packed, mapped):
        assert got.dtype == want.dtype and torch.equal(got, want)
        assert mapped_from(got, path) and got.data_ptr() % pack_cache.ALIGN == 0
    assert path.stat().st_ino == inode  # a whole replay writes no new file


def test_outside_a_session_the_pack_runs() -> None:
    packer = Packer()
    kernels = KernelContext()
    assert torch.equal(kernels.pack("p", [[2, 2]], lambda: packer([2, 2], torch.float32)), torch.arange(4.0).reshape(2, 2))
    with kernels.packing(None):
        kernels.pack("p", [[2, 2]], lambda: packer([2, 2], torch.float32))
    assert packer.calls == 2


def test_a_different_call_packs_the_rest_and_the_file_is_written_again(tmp_path: Path) -> None:
    load(tmp_path, Packer(), SHAPES)
    changed = [SHAPES[0], ([16, 48], torch.bfloat16), SHAPES[2]]
    packer = Packer()
    session, tensors = load(tmp_path, packer, changed)
    assert packer.calls == 2 and session.diverged  # the first call still came from the file
    third_packer = Packer()
    third, again = load(tmp_path, third_packer, changed)
    assert third.complete and third_packer.calls == 0
    assert all(torch.equal(a, b) for a, b in zip(tensors, again))


def test_a_changed_key_is_not_read(tmp_path: Path) -> None:
    load(tmp_path, Packer(), SHAPES)
    packer = Packer()
    session, _ = load(tmp_path, packer, SHAPES, key={**KEY, "files": [["m.gguf", 123, 457, 789]]})  # touched
    assert packer.calls == 3 and not session.replayed
    assert len(list(tmp_path.glob("*.pack"))) == 1  # the slot's one file, replaced


def test_a_recorded_value_error_is_raised_again(tmp_path: Path) -> None:
    def fused_then_plain(directory: Path, packer: Packer) -> tuple[pack_cache.PackSession, torch.Tensor]:
        session = pack_cache.session(directory, SLOT, KEY)

        def refuse() -> torch.Tensor:
            packer.calls += 1
            raise ValueError("half the rows is not a whole number of vectors")

        with pytest.raises(ValueError, match="whole number"):
            session.pack("p", ["fused"], refuse)
        tensor = session.pack("p", ["plain"], lambda: packer([4, 4], torch.float32))
        session.finish()
        pack_cache.wait_for_writes()
        return session, tensor

    first_packer, second_packer = Packer(), Packer()
    _, packed = fused_then_plain(tmp_path, first_packer)
    session, mapped = fused_then_plain(tmp_path, second_packer)
    assert first_packer.calls == 2 and second_packer.calls == 0 and session.complete
    assert torch.equal(packed, mapped)


def test_a_cut_short_file_is_packed_over(tmp_path: Path) -> None:
    first, _ = load(tmp_path, Packer(), SHAPES)
    with open(first.path, "r+b") as f:
        f.truncate(first.path.stat().st_size - 1)
    packer = Packer()
    session, _ = load(tmp_path, packer, SHAPES)
    assert packer.calls == 3 and not session.replayed


def test_nothing_is_written_without_room_on_the_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pack_cache, "MIN_FREE_DISK_BYTES", 1 << 62)
    load(tmp_path, Packer(), SHAPES)
    assert list(tmp_path.iterdir()) == []


def test_a_dead_writers_temporary_file_is_removed(tmp_path: Path) -> None:
    dead = tmp_path / f"x.pack.{2**22 + 12345}.tmp"  # above Linux's pid_max default
    live = tmp_path / f"y.pack.{os.getpid()}.tmp"
    dead.write_bytes(b"partial")
    live.write_bytes(b"partial")
    load(tmp_path, Packer(), SHAPES)
    assert not dead.exists() and live.exists()


def test_a_session_without_packs_writes_no_file(tmp_path: Path) -> None:
    session = pack_cache.session(tmp_path, SLOT, KEY)
    assert session.finish() is None and list(tmp_path.iterdir()) == []


def test_wait_for_writes_lets_a_write_finish(tmp_path: Path) -> None:
    session = pack_cache.session(tmp_path, SLOT, KEY)
    session.pack("p", [1], lambda: torch.ones(1 << 20))
    session.finish()
    pack_cache.wait_for_writes()
    assert session.path.exists() and session.path.stat().st_size >= (1 << 22)


def test_the_write_waits_while_the_model_runs_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pack_cache, "IDLE_BEFORE_WRITE_S", 1.0)
    session = pack_cache.session(tmp_path, SLOT, KEY)
    session.pack("p", [1], lambda: torch.ones(1 << 20))
    thread = session.finish()
    assert thread is not None
    for _ in range(30):  # a step every 50 ms for 1.5 s: never a second without one
        with pack_cache.stepping():
            time.sleep(0.01)
        time.sleep(0.04)
        assert thread.is_alive() and not session.path.exists()
    thread.join(timeout=60)  # no more steps: the write goes on
    assert not thread.is_alive() and session.path.exists()


def test_the_write_waits_for_a_long_step_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pack_cache, "IDLE_BEFORE_WRITE_S", 0.3)
    session = pack_cache.session(tmp_path, SLOT, KEY)
    session.pack("p", [1], lambda: torch.ones(1 << 20))
    with pack_cache.stepping():  # one step of 1.5 s, as a long prefill
        thread = session.finish()
        assert thread is not None
        time.sleep(1.5)
        assert thread.is_alive() and not session.path.exists()
    thread.join(timeout=60)
    assert not thread.is_alive() and session.path.exists()


def test_a_second_load_of_the_slot_leaves_the_write_to_the_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pack_cache, "IDLE_BEFORE_WRITE_S", 3600.0)  # the first write waits for idle time
    sessions = []
    for _ in range(2):
        session = pack_cache.session(tmp_path, SLOT, KEY)
        session.pack("p", [1], lambda: torch.ones(1 << 20))
        sessions.append(session)
    first, second = (s.finish() for s in sessions)
    assert first is not None and second is None
    pack_cache.wait_for_writes(timeout_s=60)
    assert [p.name for p in tmp_path.iterdir()] == [sessions[0].path.name]  # one whole file, no temporary one
    third = pack_cache.session(tmp_path, SLOT, KEY)
    mapped = third.pack("p", [1], lambda: pytest.fail("packed again"))
    assert third.complete and torch.equal(mapped, torch.ones(1 << 20))


def test_waiting_for_the_writes_ends_their_pauses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pack_cache, "IDLE_BEFORE_WRITE_S", 3600.0)
    session = pack_cache.session(tmp_path, SLOT, KEY)
    session.pack("p", [1], lambda: torch.ones(1 << 20))
    session.finish()
    pack_cache.wait_for_writes(timeout_s=60)
    assert session.path.exists()


def test_the_code_digest_follows_the_packing_sources() -> None:
    assert pack_cache.code_digest() == pack_cache.code_digest()
    assert len(pack_cache.code_digest()) == 16


def test_the_least_recently_used_files_make_room(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    old, recent = tmp_path / "old.pack", tmp_path / "recent.pack"
    old.write_bytes(b"x" * 10_000)
    recent.write_bytes(b"x" * 10_000)
    os.utime(old, ns=(1, 1_000_000_000))
    monkeypatch.setattr(pack_cache, "MAX_CACHE_BYTES", 10_000 + 3 * pack_cache.ALIGN)
    session, _ = load(tmp_path, Packer(), [([32, 32], torch.uint8)])  # one page of header, one of data
    assert not old.exists() and recent.exists() and session.path.exists()


def test_a_damaged_header_is_packed_over(tmp_path: Path) -> None:
    first, _ = load(tmp_path, Packer(), SHAPES)
    raw = first.path.read_bytes()
    (header_len,) = struct.unpack("<Q", raw[8:16])
    header = json.loads(raw[16 : 16 + header_len])
    header["entries"][1]["dtype"] = "no_such_dtype"
    damaged = json.dumps(header).encode()
    first.path.write_bytes(raw[:8] + struct.pack("<Q", len(damaged)) + damaged + raw[16 + len(damaged) :])
    packer = Packer()
    session, _ = load(tmp_path, packer, SHAPES)
    assert packer.calls == 3 and not session.replayed
