"""The dashboard's block map as a PNG, for ``pagellm bench compare --block-map-png PATH``.

``BlockMapRecorder`` follows an ``LLMEngine`` through a benchmark: after every step it checks how
many tokens of KV the running requests have written, and at each new peak it captures every block's
state (``pagellm.core.kv_cache_snapshot.block_code``) and how much of it is written. A new engine
core (``bench compare`` installs one per design) starts a new map. ``write_png`` draws the maps
side by side with matplotlib, in the dashboard's colours plus one more: blocks held by a request
but not written yet, which is what a contiguous reservation mostly is.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np

from pagellm.bench.baseline import ContiguousKVCacheManager
from pagellm.core.kv_cache_base import KVCacheManagerBase
from pagellm.core.kv_cache_snapshot import CACHED, block_code
from pagellm.core.scheduler import Scheduler

COLOURS = {
    "free": "#e6e9ee",
    "cached": "#9ecae1",
    "written": "#41ab5d",  # held by one request, full of KV
    "partial": "#a1d99b",  # held, partly written (the tail of a sequence)
    "reserved": "#fdd49e",  # held, nothing written yet
    "shared": "#e6550d",
}
LABELS = {
    "free": "free",
    "cached": "cached (free, in LRU)",
    "written": "in use, written",
    "partial": "in use, partly written",
    "reserved": "reserved, not written",
    "shared": "shared by several",
}


@dataclass
class BlockMap:
    kv_layout: str
    block_size: int
    codes: np.ndarray = field(repr=False)  # uint8 state per block, as the dashboard's
    written: np.ndarray = field(repr=False)  # tokens written per block (the most over its owners)
    num_running: int = 0
    num_written_tokens: int = 0

    def categories(self) -> np.ndarray:
        names = np.array(list(COLOURS))
        cat = np.full(len(self.codes), "free", dtype=object)
        cat[self.codes == CACHED] = "cached"
        held = self.codes >= 2
        cat[held & (self.written >= self.block_size)] = "written"
        cat[held & (self.written > 0) & (self.written < self.block_size)] = "partial"
        cat[held & (self.written == 0)] = "reserved"
        cat[self.codes >= 3] = "shared"
        assert set(cat) <= set(names)
        return cat

    def counts(self) -> dict[str, int]:
        cat = self.categories()
        return {name: int((cat == name).sum()) for name in COLOURS}


def capture(kv_cache_manager: KVCacheManagerBase, scheduler: Scheduler) -> BlockMap:
    """The block map now (O(blocks): for benchmarks, not for a serving engine's every step)."""
    kv_layout = "contiguous" if isinstance(kv_cache_manager, ContiguousKVCacheManager) else "paged"
    pool = kv_cache_manager.block_pool
    bs = kv_cache_manager.block_size
    codes = np.fromiter((block_code(b) for b in pool.blocks), dtype=np.uint8, count=len(pool.blocks))
    written = np.zeros(len(codes), dtype=np.int32)
    computed = {r.request_id: r.num_computed_tokens for r in (*scheduler.running, *scheduler.waiting)}
    for req_id, blocks in kv_cache_manager.req_to_blocks.items():
        n = computed.get(req_id, 0)
        for k, block in enumerate(blocks):
            w = min(bs, max(0, n - k * bs))
            if w > written[block.block_id]:
                written[block.block_id] = w
    return BlockMap(kv_layout, bs, codes, written, len(scheduler.running), int(sum(computed.values())))


class BlockMapRecorder:
    """Keeps, per KV cache (one per design run), the block map at the step where the most KV was written."""

    def __init__(self) -> None:
        self.maps: list[BlockMap] = []
        self._kv_cache_manager: Optional[KVCacheManagerBase] = None
        self._peak = -1

    @classmethod
    def install(cls, engine: Any) -> "BlockMapRecorder":
        """Wraps ``engine.step`` (this engine object only) to look at the cache after each step."""
        recorder = cls()
        step = engine.step

        def step_and_record(*args: Any, **kwargs: Any):
            out = step(*args, **kwargs)
            recorder.after_step(engine)
            return out

        engine.step = step_and_record
        return recorder

    def after_step(self, engine: Any) -> None:
        kv_cache_manager, scheduler = engine.kv_cache_view()
        if kv_cache_manager is not self._kv_cache_manager:  # a new core: a new design's run
            self._kv_cache_manager, self._peak = kv_cache_manager, -1
            self.maps.append(capture(kv_cache_manager, scheduler))
        written = sum(r.num_computed_tokens for r in scheduler.running)
        if written > self._peak:
            self._peak = written
            self.maps[-1] = capture(kv_cache_manager, scheduler)

    def write_png(self, path: str, labels: Optional[Sequence[str]] = None) -> str:
        maps = self.maps[: len(labels)] if labels is not None else self.maps
        return plot_block_maps(maps, labels or [m.kv_layout for m in maps], path)


def _grid(n: int, aspect: float = 1.6) -> tuple[int, int]:
    cols = max(1, math.ceil(math.sqrt(n * aspect)))
    return cols, math.ceil(n / cols)


def plot_block_maps(maps: Sequence[BlockMap], labels: Sequence[str], path: str) -> str:
    """Draws the maps side by side into ``path`` (a .png file, or a directory to put block_map.png in)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgb
    from matplotlib.patches import Patch

    if not maps:
        raise ValueError("no block map was recorded")
    if os.path.isdir(path) or not path.lower().endswith(".png"):
        os.makedirs(path, exist_ok=True)
        path = os.path.join(path, "block_map.png")
    elif os.path.dirname(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    rgb = {name: np.array(to_rgb(c)) for name, c in COLOURS.items()}
    fig, axes = plt.subplots(1, len(maps), figsize=(6.4 * len(maps), 5.2), squeeze=False)
    for ax, m, label in zip(axes[0], maps, labels):
        cat = m.categories()
        cols, rows = _grid(len(cat))
        img = np.ones((rows, cols, 3))
        for name, colour in rgb.items():
            idx = np.nonzero(cat == name)[0]
            img[idx // cols, idx % cols] = colour
        ax.imshow(img, interpolation="nearest", aspect="equal")
        if cols <= 80:  # thin white lines between cells while they are big enough to see
            ax.set_xticks(np.arange(-0.5, cols, 1), minor=True)
            ax.set_yticks(np.arange(-0.5, rows, 1), minor=True)
            ax.grid(which="minor", color="white", linewidth=0.6)
            ax.tick_params(which="minor", length=0)
        ax.set_xticks([])
        ax.set_yticks([])
        counts = m.counts()
        held = len(cat) - counts["free"] - counts["cached"]
        written_share = float(m.written[m.codes >= 2].sum()) / (held * m.block_size) if held else 0.0
        ax.set_title(
            f"{label}: {m.num_running} requests running\n"
            f"{held} of {len(cat)} blocks held, {100 * written_share:.0f}% of what is held written",
            fontsize=10,
        )
    handles = [Patch(color=c, label=LABELS[n]) for n, c in COLOURS.items()]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=9, frameon=False)
    fig.suptitle(f"KV block maps at each design's peak of written KV ({maps[0].block_size}-token blocks)", fontsize=11)
    fig.tight_layout(rect=(0, 0.06, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
