"""The dashboard's hub: what ``GET /dashboard`` (router.py) streams, a live view of the paged KV
cache, its requests and the engine's counters.

The page (``static/dashboard.html`` + ``dashboard.js``, uPlot vendored beside them, no build step)
reads one server-sent-event stream, ``/dashboard/events``:

* ``full``: the whole block map and queues (on connect, or after a client fell behind);
* ``diff``: what changed since the previous event (changed blocks, grown tables, the queues);
* ``stats``: one point of the time series (KV usage, prefix hit share, tokens/s, batch size,
  TTFT / inter-token latency percentiles), computed from the same Prometheus counters as
  ``/metrics``; the first one carries the recent history.

One ``DashboardHub`` per app polls the engine a few times a second, only while a client is
connected. Each poll runs on the engine thread between steps (``AsyncLLM.run_in_engine``), and
reads only the blocks the pool marked dirty (``pagellm.core.kv_cache_snapshot``); serialization
and fan-out to clients happen on the event loop. Hovering a block asks ``/dashboard/api/block/ID``
(a hybrid model's state slot ``/dashboard/api/slot/ID``), answered on the engine thread too.

With ``--api-key`` the dashboard needs the key like the API: ``Authorization: Bearer KEY``, or
``/dashboard?key=KEY`` once, which sets an HttpOnly cookie for the page and its stream and
redirects to drop the key from the address bar. Token text is sent only with
``--dashboard-show-text``.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from typing import Any, AsyncIterator, Optional

from pagellm.core.kv_cache_snapshot import KVCacheSnapshotter
from pagellm.engine.async_llm import AsyncLLM
from pagellm.entrypoints.metrics import EngineMetrics
from pagellm.entrypoints.server_state import ServerState

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.25
STATS_HISTORY = 480  # points kept for a client that connects later (2 minutes at 4 per second)
CLIENT_QUEUE = 64  # events a slow client may lag before it is resynced with a full snapshot


# -- the time series, from the /metrics registry ---------------------------------------------------


def histogram_quantile(q: float, bounds: list[float], cumulative: list[float]) -> Optional[float]:
    """Prometheus' ``histogram_quantile``: ``cumulative[i]`` observations were <= ``bounds[i]``
    (the last bound may be +inf); linear within a bucket. None without observations."""
    total = cumulative[-1] if cumulative else 0
    if total <= 0:
        return None
    rank = q * total
    prev_bound, prev_count = 0.0, 0.0
    for bound, count in zip(bounds, cumulative):
        if count >= rank:
            if bound == float("inf"):
                return prev_bound
            if count == prev_count:
                return bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = bound, count
    return prev_bound


class StatsSampler:
    """Points of the dashboard's charts from an ``EngineMetrics`` registry (thread-safe reads)."""

    RATE_WINDOW_S = 2.0  # tokens/s and the prefix hit share over this much of the past
    LATENCY_WINDOW_S = 15.0  # latency percentiles over the observations of this much of the past

    def __init__(self, metrics: Any) -> None:
        self.metrics = metrics
        self._raw: deque[tuple[float, dict[str, Any]]] = deque()
        self.history: deque[dict[str, Any]] = deque(maxlen=STATS_HISTORY)

    def read(self) -> dict[str, Any]:
        values: dict[str, Any] = {}
        for family in self.metrics.registry.collect():
            for s in family.samples:
                if s.name.endswith("_bucket"):
                    values.setdefault(s.name, []).append((float(s.labels["le"]), s.value))
                else:
                    values[s.name] = s.value
        return values

    def _past(self, now: float, window: float) -> dict[str, Any]:
        for t, raw in self._raw:
            if t >= now - window:
                return raw
        return self._raw[-1][1]

    def sample(self, now: Optional[float] = None) -> dict[str, Any]:
        now = time.time() if now is None else now
        raw = self.read()
        self._raw.append((now, raw))
        while self._raw and self._raw[0][0] < now - self.LATENCY_WINDOW_S - 1:
            self._raw.popleft()
        rate_t, rate_base = next(((t, r) for t, r in self._raw if t >= now - self.RATE_WINDOW_S), (now, raw))
        dt = now - rate_t

        def delta(name: str, base: dict[str, Any]) -> float:
            return raw.get(name, 0.0) - base.get(name, 0.0)

        queries = delta("pagellm:prefix_cache_queries_total", rate_base)
        point = {
            "t": now,
            "kv_usage": raw.get("pagellm:kv_cache_usage_perc", 0.0),
            "prefix_hit_share": delta("pagellm:prefix_cache_hits_total", rate_base) / queries if queries else None,
            "gen_tps": delta("pagellm:generation_tokens_total", rate_base) / dt if dt > 0 else None,
            "prompt_tps": delta("pagellm:prompt_tokens_total", rate_base) / dt if dt > 0 else None,
            "running": raw.get("pagellm:num_requests_running", 0.0),
            "waiting": raw.get("pagellm:num_requests_waiting", 0.0),
            "preemptions": raw.get("pagellm:num_preemptions_total", 0.0),
        }
        drafted = delta("pagellm:spec_decode_num_draft_tokens_total", rate_base)
        if drafted:  # speculative decoding: the share of drafts accepted, tokens a verification yields
            point["spec_acceptance"] = delta("pagellm:spec_decode_num_accepted_tokens_total", rate_base) / drafted
            num_drafts = delta("pagellm:spec_decode_num_drafts_total", rate_base)
            point["spec_tokens_per_verification"] = 1 + point["spec_acceptance"] * drafted / num_drafts if num_drafts else None
        if "pagellm:kv_tier_pages" in raw and dt > 0:  # the offloading tier: what it served and moved
            point["tier_hit_tps"] = delta("pagellm:kv_tier_hit_tokens_total", rate_base) / dt
            point["tier_read_mbps"] = delta("pagellm:kv_tier_bytes_read_total", rate_base) / dt / 1e6
            point["tier_write_mbps"] = delta("pagellm:kv_tier_bytes_written_total", rate_base) / dt / 1e6
            point["tier_pages"] = raw["pagellm:kv_tier_pages"]
        base = self._raw[0][1]
        for key, name in (("ttft", "pagellm:time_to_first_token_seconds_bucket"), ("tpot", "pagellm:inter_token_latency_seconds_bucket")):
            buckets = raw.get(name, [])
            old = dict(base.get(name, []))
            bounds = [b for b, _ in buckets]
            counts = [c - old.get(b, 0.0) for b, c in buckets]
            for q in (50, 90, 99):
                point[f"{key}_p{q}"] = histogram_quantile(q / 100, bounds, counts)
        self.history.append(point)
        return point


# -- the hub: one poller, many SSE clients -----------------------------------------------------------


class _Client:
    def __init__(self) -> None:
        self.queue: asyncio.Queue[Optional[bytes]] = asyncio.Queue(maxsize=CLIENT_QUEUE)
        self.need_full = True
        self.sent_history = False

    def send(self, payload: Optional[bytes]) -> None:
        try:
            self.queue.put_nowait(payload)
        except asyncio.QueueFull:  # fell behind: drop what it has not read, resync with a full snapshot
            while not self.queue.empty():
                self.queue.get_nowait()
            self.need_full = True
            if payload is None:
                self.queue.put_nowait(None)


def _event(kind: str, data: Any) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


class DashboardHub:
    def __init__(
        self,
        async_llm: AsyncLLM,
        metrics: EngineMetrics,
        server_state: ServerState,
        show_text: bool = False,
        interval_s: float = POLL_INTERVAL_S,
    ) -> None:
        self.async_llm = async_llm
        self.server_state = server_state
        self.show_text = show_text
        self.interval_s = interval_s
        self.stats = StatsSampler(metrics)
        self.clients: set[_Client] = set()
        self._task: Optional[asyncio.Task] = None
        # Engine thread only:
        self._snapshotter: Optional[KVCacheSnapshotter] = None
        self._pending: list[dict] = []
        self._reset = False
        self.num_polls = 0
        # What the dashboard costs: seconds on the engine thread (polls, between steps) and on the
        # event loop (serialization, fan-out), served by /dashboard/api/cost.
        self.engine_s = 0.0
        self.loop_s = 0.0

    # engine thread -----------------------------------------------------------------------------------
    # The snapshotter is the pool's only reader of dirty blocks, so every diff it makes must reach the
    # clients: diffs made outside a tick (a snapshot request) wait in _pending for the next tick.

    def _snap(self, engine: Any) -> KVCacheSnapshotter:
        kv_cache_manager, scheduler = engine.kv_cache_view()
        snap = self._snapshotter
        if snap is not None and snap.kv_cache_manager is kv_cache_manager:
            return snap
        decode = None
        if self.show_text:
            tokenizer = engine.tokenizer
            decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
        plan = getattr(engine, "memory_plan", None)
        cache_info = None
        if plan is not None:
            cache_info = {"dtype": plan.kv_cache_dtype, "bytes": plan.kv_cache_bytes, "tokens": plan.kv_cache_tokens}
            if plan.num_state_slots:  # a hybrid model: its recurrent state slots' share of those bytes
                cache_info.update(state_bytes=plan.state_bytes, state_slots=plan.num_state_slots)
        self._snapshotter = KVCacheSnapshotter(kv_cache_manager, scheduler, decode, cache_info)
        self._pending.clear()
        self._reset = True  # a new mirror: every client starts again from a full snapshot
        return self._snapshotter

    def _poll(self, want_full: bool, engine: Any) -> tuple[list[dict], Optional[dict], bool]:
        t0 = time.perf_counter()
        snap = self._snap(engine)
        diff = snap.poll()
        self.num_polls += 1
        diffs, self._pending = self._pending, []
        if diff is not None:
            diffs.append(diff)
        reset, self._reset = self._reset, False
        full = snap.full() if want_full or reset else None
        self.engine_s += time.perf_counter() - t0
        return diffs, full, reset

    def _full_now(self, engine: Any) -> dict[str, Any]:
        snap = self._snap(engine)
        diff = snap.poll()
        if diff is not None:
            self._pending.append(diff)
        return snap.full()

    def _describe_block(self, block_id: int, engine: Any) -> dict[str, Any]:
        return self._snap(engine).describe_block(block_id)

    def _describe_slot(self, slot_id: int, engine: Any) -> dict[str, Any]:
        return self._snap(engine).describe_slot(slot_id)

    # event loop --------------------------------------------------------------------------------------

    async def snapshot(self) -> dict[str, Any]:
        return await self.async_llm.run_in_engine(self._full_now)

    async def describe_block(self, block_id: int) -> dict[str, Any]:
        return await self.async_llm.run_in_engine(lambda e: self._describe_block(block_id, e))

    async def describe_slot(self, slot_id: int) -> dict[str, Any]:
        return await self.async_llm.run_in_engine(lambda e: self._describe_slot(slot_id, e))

    async def stream(self) -> AsyncIterator[bytes]:
        client = _Client()
        self.clients.add(client)
        if self._task is None:
            self._task = asyncio.create_task(self._run())
        try:
            yield b"retry: 2000\n\n"
            while True:
                payload = await client.queue.get()
                if payload is None:
                    return
                yield payload
        finally:
            self.clients.discard(client)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self.clients and not self.server_state.draining and not self.async_llm.is_dead:
                t0 = loop.time()
                await self._tick()
                await asyncio.sleep(max(0.0, self.interval_s - (loop.time() - t0)))
        except Exception:
            logger.exception("the dashboard poller stopped")
        finally:
            self._task = None
            for client in list(self.clients):
                client.send(None)
            self.clients.clear()

    async def _tick(self) -> None:
        want_full = any(c.need_full for c in self.clients)
        diffs, full, reset = await self.async_llm.run_in_engine(lambda e: self._poll(want_full, e))
        t0 = time.perf_counter()
        try:
            self._fan_out(diffs, full, reset)
        finally:
            self.loop_s += time.perf_counter() - t0

    def _fan_out(self, diffs: list[dict], full: Optional[dict], reset: bool) -> None:
        point = self.stats.sample()
        diff_events = [_event("diff", d) for d in diffs]
        full_event = _event("full", full) if full is not None else None
        stats_event = _event("stats", point)
        for client in list(self.clients):
            if reset:
                client.need_full = True
            if client.need_full:
                if full_event is None:
                    continue  # connected during this poll: served at the next tick
                client.need_full = False
                client.send(full_event)
            else:
                for event in diff_events:
                    client.send(event)
            if not client.sent_history:
                client.sent_history = True
                client.send(_event("history", list(self.stats.history)))
            else:
                client.send(stats_event)


# -- routes ------------------------------------------------------------------------------------------
