"""The block-map PNG of ``pagellm bench compare --block-map-png``: captured states, peak choice, drawing."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from sched_utils import FakeRunner, make_request

from pagellm.bench.baseline import ContiguousKVCacheManager, StaticBatchScheduler
from pagellm.bench.block_map import BlockMapRecorder, capture, plot_block_maps
from pagellm.cli import main
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.scheduler import Scheduler


class ToyEngine:
    """Just what the recorder reads: ``core.kv_cache_manager``, ``core.scheduler``, ``step()``."""

    def __init__(self, kv, layout: str) -> None:
        scheduler_cls = StaticBatchScheduler if layout == "contiguous" else Scheduler
        sched = scheduler_cls(kv, 8, 64, 64)
        self.core = SimpleNamespace(kv_cache_manager=kv, scheduler=sched)
        self.runner = FakeRunner(kv.block_size)

    def kv_cache_view(self):
        return self.core.kv_cache_manager, self.core.scheduler

    def step(self):
        sched = self.core.scheduler
        out = sched.schedule()
        return sched.update_from_output(out, self.runner.execute(out, sched.requests))


def run(engine, prompts, max_tokens):
    sched = engine.core.scheduler
    for i, p in enumerate(prompts):
        sched.add_request(make_request(sched, f"r{i}", p, max_tokens=max_tokens))
    while sched.has_unfinished_requests():
        engine.step()


def test_paged_and_contiguous_maps_at_peak(tmp_path):
    recorder = BlockMapRecorder()
    paged = ToyEngine(KVCacheManager(16, 4, 64, enable_caching=True), "paged")
    contiguous = ToyEngine(ContiguousKVCacheManager(16, 4, 16, reserve="max_model_len"), "contiguous")
    for engine in (paged, contiguous):
        step = engine.step
        engine.step = lambda step=step, engine=engine: (step(), recorder.after_step(engine))[0]
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8, 10]]
    run(paged, prompts, max_tokens=3)
    run(contiguous, prompts, max_tokens=3)
    assert len(recorder.maps) == 2
    p, c = recorder.maps
    # Paged at its peak (both running, 10 tokens written each: the last sampled token is never fed
    # back): 2 shared prefix blocks, one own block each.
    assert p.num_running == 2 and p.num_written_tokens == 20
    assert p.counts() == {"free": 12, "cached": 0, "written": 0, "partial": 2, "reserved": 0, "shared": 2}
    assert list(p.codes[:4]) == [3, 3, 2, 2] and list(p.written[:4]) == [4, 4, 2, 2]
    # Contiguous: each reserves max_model_len (16 tokens = 4 blocks) at admission, 10 written of it.
    assert c.num_running == 2 and c.counts() == {"free": 8, "cached": 0, "written": 4, "partial": 2, "reserved": 2, "shared": 0}
    out = plot_block_maps(recorder.maps, ["paged", "contiguous"], str(tmp_path / "maps.png"))
    assert Path(out).stat().st_size > 5000
    assert plot_block_maps([p], ["paged"], str(tmp_path / "dir")).endswith("dir/block_map.png")


def test_install_wraps_step_and_capture_reads_tables():
    engine = ToyEngine(KVCacheManager(8, 4, 64, enable_caching=False), "paged")
    recorder = BlockMapRecorder.install(engine)
    run(engine, [[5, 6, 7, 8, 9]], max_tokens=4)
    (m,) = recorder.maps
    assert m.num_written_tokens == 7 and list(m.written[:2]) == [4, 3]
    assert m.counts()["written"] == m.counts()["partial"] == 1
    now = capture(engine.core.kv_cache_manager, engine.core.scheduler)
    assert now.counts()["free"] == 8  # all done: nothing held


@pytest.mark.slow
def test_bench_compare_writes_block_map_png(tmp_path):
    rc = main([
        "--log-level", "warning", "bench", "compare",
        "--num-prompts", "6",
        "--variable-input-min", "8", "--variable-input-max", "24",
        "--variable-output-min", "2", "--variable-output-max", "12", "--variable-output-median", "4",
        "--max-model-len", "64", "--num-kv-blocks", "16", "--block-size", "16",
        "--block-map-png", str(tmp_path / "block_map.png"),
        "--disable-tqdm",
    ])
    assert rc == 0
    assert (tmp_path / "block_map.png").stat().st_size > 5000
