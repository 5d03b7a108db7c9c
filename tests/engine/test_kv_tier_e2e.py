"""The disk tier under the prefix cache, end to end on the default model (float32, so that a prefix
hit's greedy output equals a cold run's exactly): prefixes evicted from a small KV budget come back
from disk, across a restart too, and every fault (damaged, truncated or foreign files, a full disk,
a server killed mid-write) costs a recompute and a counter, never a wrong token or a crash."""
from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from engine.kv_tier_utils import random_docs, run_each, tier_args, tier_stats

from pagellm import LLM, SamplingParams
from pagellm.core.block_hash import hash_full_blocks

pytestmark = pytest.mark.slow

NUM_DOCS, DOC_LEN = 4, 100
PARAMS = SamplingParams(temperature=0.0, max_tokens=6)


def _docs() -> list[list[int]]:
    return random_docs(NUM_DOCS, DOC_LEN, 100, 40000)


def _llm(tier_dir: Path | None, **kwargs) -> LLM:
    # 6 MiB of float32 KV: 8 blocks, one document at a time, so each evicts the one before it.
    return LLM(dtype="float32", kv_cache_memory_bytes=6 * 2**20, max_model_len=128, **tier_args(tier_dir, 0.25), **kwargs)


def _drain(llm: LLM) -> None:
    llm.llm_engine.core.executor.worker.runner.offloader.drain()


@pytest.fixture(scope="module")
def cold() -> list[list[int]]:
    llm = _llm(None)
    try:
        return [tokens for tokens, _ in run_each(llm, _docs(), PARAMS)]
    finally:
        llm.shutdown()


@pytest.fixture
def filled_dir(tmp_path: Path) -> Path:
    """A tier directory holding every document's prefix: a second pass evicts what the first left."""
    llm = _llm(tmp_path / "tier")
    try:
        docs = _docs()
        run_each(llm, docs + docs, PARAMS)
        _drain(llm)
    finally:
        llm.shutdown()
    return tmp_path / "tier"


def _files(tier_dir: Path) -> list[Path]:
    return sorted(tier_dir.rglob("*.kv"))


def test_evicted_prefixes_come_back_from_disk_with_the_cold_output(tmp_path, cold):
    llm = _llm(tmp_path / "tier")
    try:
        docs = _docs()
        first = run_each(llm, docs, PARAMS)
        again = run_each(llm, docs, PARAMS)
        assert [t for t, _ in first] == cold and [t for t, _ in again] == cold
        assert [hit for _, hit in first] == [0] * NUM_DOCS
        assert all(hit == DOC_LEN // 16 * 16 for _, hit in again)  # every full block: from memory or disk
        core, worker = tier_stats(llm)
        assert core.num_loads >= NUM_DOCS - 1 and core.num_blocks_failed == 0
        assert worker.bytes_read > 0 and worker.bytes_written >= worker.bytes_read
    finally:
        llm.shutdown()


def test_after_a_restart_the_prefix_is_read_from_disk(filled_dir, cold):
    llm = _llm(filled_dir)
    try:
        core, _ = tier_stats(llm)
        assert core.num_keys >= NUM_DOCS * (DOC_LEN // 16)  # the index rebuilt from the files
        result = run_each(llm, _docs(), PARAMS)
        assert [t for t, _ in result] == cold
        assert all(hit == DOC_LEN // 16 * 16 for _, hit in result)
        assert tier_stats(llm)[0].num_blocks_loaded >= NUM_DOCS * (DOC_LEN // 16)
    finally:
        llm.shutdown()


def _first_page(tier_dir: Path, doc: list[int]) -> Path:
    (path,) = tier_dir.rglob(f"{hash_full_blocks(doc, 16)[0].hex()}.kv")
    return path


def test_damaged_truncated_and_foreign_files_are_misses_and_counted(filled_dir, tmp_path, cold):
    docs = _docs()
    truncated = _first_page(filled_dir, docs[0])
    truncated.write_bytes(truncated.read_bytes()[:-1000])
    flipped = _first_page(filled_dir, docs[1])
    data = bytearray(flipped.read_bytes())
    data[-100] ^= 0xFF  # one payload byte
    flipped.write_bytes(bytes(data))
    # A file from another configuration (block size 32) under this one's name for doc 2's page.
    other = _llm(tmp_path / "other", block_size=32)
    try:
        run_each(other, docs + docs[:1], PARAMS)
        _drain(other)
    finally:
        other.shutdown()
    _first_page(filled_dir, docs[2]).write_bytes(_files(tmp_path / "other")[0].read_bytes())
    llm = _llm(filled_dir)
    try:
        result = run_each(llm, docs, PARAMS)
        assert [t for t, _ in result] == cold  # docs 0-2 recomputed from their first block, doc 3 loaded
        core, worker = tier_stats(llm)
        # The restart's scan reads headers: the truncated and the foreign file never enter the index;
        # the flipped byte is caught by the checksum when doc 1 loads, which then recomputes.
        assert worker.num_corrupt == 3 and core.num_keys == NUM_DOCS * (DOC_LEN // 16) - 3 + core.num_saves
        assert core.num_blocks_failed == DOC_LEN // 16 and core.num_blocks_loaded == DOC_LEN // 16
    finally:
        llm.shutdown()


def test_a_full_disk_degrades_to_recomputing(tmp_path, cold, monkeypatch):
    real_write = os.write

    def full(fd, data):  # writes to the tier's temp files fail as on a full disk
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".tmp"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full)
    llm = _llm(tmp_path / "tier")
    try:
        docs = _docs()
        assert [t for t, _ in run_each(llm, docs + docs, PARAMS)] == cold + cold
        _drain(llm)
        core, worker = tier_stats(llm)
        assert worker.num_write_errors > 0 and worker.bytes_written == 0 and core.num_blocks_loaded == 0
    finally:
        llm.shutdown()


_WRITER = """
import random, sys
from pagellm import LLM, SamplingParams
rng = random.Random(1)
llm = LLM(dtype="float32", kv_cache_memory_bytes=6 * 2**20, max_model_len=128, kv_offloading_backend="native",
          kv_offloading_size=0.25, kv_offloading_dir=sys.argv[1])
print("ready", flush=True)
while True:
    llm.generate([{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(100)]}], SamplingParams(max_tokens=1), use_tqdm=False)
"""


def test_a_server_killed_mid_write_leaves_nothing_that_is_read(tmp_path, cold):
    tier = tmp_path / "tier"
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(tier)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 120
        while len(_files(tier)) < 20 and time.monotonic() < deadline:  # writing steadily
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert _files(tier)
    llm = _llm(tier)
    try:
        assert [t for t, _ in run_each(llm, _docs(), PARAMS)] == cold
        assert not list(tier.rglob("*.tmp*"))  # the restart's scan removed the half-written files
        assert tier_stats(llm)[1].num_corrupt == 0
    finally:
        llm.shutdown()


def test_a_clean_shutdown_writes_what_is_still_in_memory(tmp_path, cold):
    llm = _llm(tmp_path / "tier")
    try:
        assert run_each(llm, _docs()[:1], PARAMS)[0] == (cold[0], 0)
        assert tier_stats(llm)[0].num_saves == 0  # nothing evicted yet
    finally:
        llm.shutdown()  # flushes the cached blocks to the tier
    assert len(_files(tmp_path / "tier")) == DOC_LEN // 16
    llm = _llm(tmp_path / "tier")
    try:
        assert run_each(llm, _docs()[:1], PARAMS)[0] == (cold[0], DOC_LEN // 16 * 16)
        assert tier_stats(llm)[0].num_blocks_loaded == DOC_LEN // 16
    finally:
        llm.shutdown()
