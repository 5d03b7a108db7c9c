"""/dashboard on a model-free engine with a real KV cache manager and scheduler: key, off switch, privacy."""
from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import threading
import time

import httpx
import pytest
import uvicorn
from fake_engine import FakeEngine
from openai_server_utils import free_port

from pagellm.core.block_hash import make_block_hasher
from pagellm.core.kv_cache_groups import group_layers
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.sched_output import ModelRunnerOutput
from pagellm.core.scheduler import Scheduler
from pagellm.engine.async_llm import AsyncLLM
from pagellm.entrypoints.dashboard.hub import StatsSampler, histogram_quantile
from pagellm.entrypoints.metrics import EngineMetrics
from pagellm.entrypoints.openai.api_server import build_app
from pagellm.plan.memory_plan import MemoryPlan
from pagellm.request import Request
from pagellm.sampling_params import SamplingParams

API_KEY = "sk-dash-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
SECRET = "My SECRET prompt text"
BLOCK_SIZE = 4


def engine_with_requests() -> FakeEngine:
    """A fake engine whose core has a real cache and scheduler holding two requests that share blocks."""
    engine = FakeEngine(max_model_len=64)
    kv = KVCacheManager(32, BLOCK_SIZE, 64, enable_caching=True)
    sched = Scheduler(kv, 8, 64, 64)
    engine.kv_cache_view = lambda: (kv, sched)
    ids = engine.tokenizer.encode(SECRET)
    for i in range(2):
        p = SamplingParams(max_tokens=4)
        sched.add_request(Request(f"req-{i}", ids, p, 4, block_hasher=make_block_hasher(BLOCK_SIZE)))
        sched.schedule()  # the second adopts the first's full blocks
    return engine


STATE_SLOT_BYTES = 5 << 20


def hybrid_engine_with_requests() -> FakeEngine:
    """As ``engine_with_requests``, for a hybrid model (three recurrent layers beside an attention
    layer, 8 state slots, a checkpoint every 8 tokens), with a memory plan that prices its slots."""
    engine = FakeEngine(max_model_len=64)
    layout = group_layers([None] * 4, state_layer_ids=(0, 1, 2))
    kv = KVCacheManager(32, BLOCK_SIZE, 64, True, layout, num_state_slots=8, state_checkpoint_interval=8)
    sched = Scheduler(kv, 8, 64, 64)
    engine.kv_cache_view = lambda: (kv, sched)
    engine.memory_plan = MemoryPlan(0, 0, 1 << 20, 0, None, state_bytes=8 * STATE_SLOT_BYTES, num_state_slots=8)
    ids = engine.tokenizer.encode(SECRET)
    for i in range(2):
        sched.add_request(Request(f"req-{i}", ids, SamplingParams(max_tokens=4), 4, block_hasher=make_block_hasher(BLOCK_SIZE)))
        out = sched.schedule()
        # The step ran (each prompt whole, one token sampled): its checkpoints are saved.
        sched.update_from_output(out, ModelRunnerOutput({req_id: [7] for req_id in out.num_scheduled_tokens}))
    return engine


@contextlib.contextmanager
def live_server(make_engine=engine_with_requests, **app_kwargs):
    engine = make_engine()
    metrics = EngineMetrics(engine.model_name)
    llm = AsyncLLM(engine, stat_logger=metrics)
    app = build_app(llm, metrics, **app_kwargs)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off", log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", app, engine
    finally:
        server.should_exit = True
        thread.join(10)
        llm.shutdown()


def read_events(url: str, headers: dict, seconds: float = 1.0, cookies: dict | None = None) -> list[tuple[str, dict]]:
    events, kind = [], None
    deadline = time.monotonic() + seconds
    with httpx.stream("GET", url + "/dashboard/events", headers=headers, cookies=cookies, timeout=10) as resp:
        assert resp.status_code == 200, resp.read()
        assert resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if line.startswith("event: "):
                kind = line[len("event: "):]
            elif line.startswith("data: "):
                events.append((kind, json.loads(line[len("data: "):])))
                if time.monotonic() > deadline:
                    break
    return events


def test_key_required_on_every_dashboard_route_and_cookie_login():
    with live_server(api_key=API_KEY) as (url, _, _):
        for path in ("/dashboard", "/dashboard/events", "/dashboard/api/snapshot", "/dashboard/api/block/0", "/dashboard/api/slot/0"):
            resp = httpx.get(url + path)
            assert resp.status_code == 401, path
            assert resp.json()["error"]["type"] == "AuthenticationError"
            assert httpx.get(url + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
            assert httpx.get(url + path, params={"key": "wrong"}).status_code == 401
        assert httpx.get(url + "/dashboard", headers=AUTH).status_code == 200
        # ?key= sets an HttpOnly cookie scoped to /dashboard and redirects the key out of the address bar.
        with httpx.Client(base_url=url, follow_redirects=True) as browser:
            resp = browser.get("/dashboard", params={"key": API_KEY})
            assert resp.status_code == 200 and str(resp.url).endswith("/dashboard") and "<canvas" in resp.text
            assert "httponly" in resp.history[0].headers["set-cookie"].lower()
            assert browser.get("/dashboard/api/snapshot").status_code == 200
        # The static assets hold no data.
        assert httpx.get(url + "/dashboard/static/uPlot.iife.min.js").status_code == 200
        assert httpx.get(url + "/dashboard/static/..%2Fdashboard.py").status_code == 404


def test_no_dashboard_means_404():
    with live_server(api_key=None, dashboard=False) as (url, _, _):
        for path in ("/dashboard", "/dashboard/events", "/dashboard/api/snapshot"):
            assert httpx.get(url + path).status_code == 404


@pytest.mark.parametrize("show_text", [False, True])
def test_request_text_only_with_show_text(show_text):
    with live_server(api_key=API_KEY, dashboard_show_text=show_text) as (url, _, _):
        events = read_events(url, AUTH, seconds=0.8)
        kinds = [k for k, _ in events]
        assert kinds[0] == "full" and "history" in kinds
        full = events[0][1]
        payload = json.dumps(events) + httpx.get(url + "/dashboard/api/block/0", headers=AUTH).text
        assert (SECRET in payload) is show_text
        assert ("SECRET" in payload) is show_text
        # Exact state: 21 tokens = 5 full blocks + 1 partial (blocks 0-5) for req-0; req-1 shares the
        # first 5 (the last prompt token is never a cache hit) and owns block 6.
        codes = list(base64.b64decode(full["codes"]))
        assert codes[:7] == [3, 3, 3, 3, 3, 2, 2] and set(codes[7:]) == {0}
        assert full["tables"] == {"req-0": [0, 1, 2, 3, 4, 5], "req-1": [0, 1, 2, 3, 4, 6]}
        assert full["counts"] == {"free": 25, "cached": 0, "used": 2, "shared": 5, "engine_free": 25, "engine_used": 7}
        assert "state" not in full  # no recurrent layers: no state slots, no panel
        assert httpx.get(url + "/dashboard/api/slot/0", headers=AUTH).status_code == 404
        block = httpx.get(url + "/dashboard/api/block/1", headers=AUTH).json()
        assert block["state"] == "shared" and block["ref_cnt"] == 2 and len(block["hash"]) == 12
        assert [o["id"] for o in block["owners"]] == ["req-0", "req-1"]
        assert ("text" in block) is show_text


def _free_req0(engine) -> None:
    """Ends req-0 inside the engine, as a finished request leaves the batch (runs on its thread)."""
    kv, sched = engine.kv_cache_view()
    req = sched.requests["req-0"]
    sched.running.remove(req)
    kv.free(req)


def test_diffs_follow_engine_changes():
    with live_server(api_key=None) as (url, app, engine):
        hub = app.state.dashboard
        got: list = []

        def reader():
            got.extend(read_events(url, {}, seconds=1.5))

        t = threading.Thread(target=reader)
        t.start()
        time.sleep(0.6)

        asyncio.run(hub.async_llm.run_in_engine(_free_req0))
        t.join()
        diffs = [d for k, d in got if k == "diff"]
        assert len(diffs) == 1, got
        # Block 5 (req-0's own) frees; the shared ones drop to one owner; req-0's table goes.
        assert diffs[0]["blocks"] == [[0, 2], [1, 2], [2, 2], [3, 2], [4, 2], [5, 0]]
        assert diffs[0]["tables_removed"] == ["req-0"]
        assert diffs[0]["v"] == got[0][1]["v"] + 1
        assert hub.num_polls >= 3  # it kept polling, and sent nothing when nothing changed


def test_histogram_quantile_and_stats_sampler():
    assert histogram_quantile(0.5, [1.0, 2.0, float("inf")], [0, 0, 0]) is None
    assert histogram_quantile(0.5, [1.0, 2.0, float("inf")], [10, 20, 20]) == pytest.approx(1.0)
    assert histogram_quantile(0.75, [1.0, 2.0, float("inf")], [10, 20, 20]) == pytest.approx(1.5)
    assert histogram_quantile(0.99, [1.0, 2.0, float("inf")], [10, 10, 20]) == 2.0
    metrics = EngineMetrics("m")
    sampler = StatsSampler(metrics)
    sampler.sample(now=100.0)
    metrics.generation_tokens.inc(50)
    metrics.prefix_cache_queries.inc(200)
    metrics.prefix_cache_hits.inc(150)
    metrics.kv_cache_usage.set(0.25)
    for v in (0.03, 0.03, 0.07, 0.3):
        metrics.time_to_first_token.observe(v)
    p = sampler.sample(now=101.0)
    assert p["gen_tps"] == pytest.approx(50.0) and p["prefix_hit_share"] == pytest.approx(0.75)
    assert p["kv_usage"] == 0.25 and p["tpot_p50"] is None
    assert 0.02 < p["ttft_p50"] <= 0.04 and 0.25 < p["ttft_p99"] <= 0.5


def test_hybrid_state_slots_in_the_snapshot_diffs_and_hover():
    with live_server(hybrid_engine_with_requests, api_key=None) as (url, app, engine):
        hub = app.state.dashboard
        got: list = []
        t = threading.Thread(target=lambda: got.extend(read_events(url, {}, seconds=1.5)))
        t.start()
        time.sleep(0.6)

        asyncio.run(hub.async_llm.run_in_engine(_free_req0))
        t.join()
        full = got[0][1]
        # req-0 (21 tokens) runs in slot 0 and saved its state at 8, 16 and 20 tokens (slots 1-3);
        # req-1, the same prompt, resumed from the one at 20 into slot 4.
        state = full["state"]
        assert list(base64.b64decode(state["codes"])) == [2, 1, 1, 1, 2, 0, 0, 0]
        assert state["owners"] == {"req-0": 0, "req-1": 4} and state["num_slots"] == 8 and state["checkpoint_interval"] == 8
        assert state["counts"] == {
            "free": 3, "checkpoint": 3, "live": 2, "saving": 0, "engine_live": 2, "engine_checkpoints": 3, "engine_free": 6,
            "written": 3, "restored": 1, "slot_bytes": STATE_SLOT_BYTES, "checkpoint_bytes": 3 * STATE_SLOT_BYTES,
        }
        assert full["cache"]["state_slots"] == 8
        diffs = [d for k, d in got if k == "diff"]
        assert len(diffs) == 1, got
        counts = {**state["counts"], "free": 4, "live": 1, "engine_live": 1, "engine_free": 7}
        assert diffs[0]["state"] == {"slots": [[0, 0]], "owners_removed": ["req-0"], "counts": counts}
        slot = httpx.get(url + "/dashboard/api/slot/4").json()
        assert slot == {"id": 4, "state": "live", "ref_cnt": 1, "owner": "req-1", "hash": None, "kv_block": None}
        checkpoint = httpx.get(url + "/dashboard/api/slot/3").json()
        assert checkpoint["state"] == "checkpoint" and checkpoint["owner"] is None and checkpoint["kv_block"] == 4
        assert checkpoint["hash"] == httpx.get(url + "/dashboard/api/block/4").json()["hash"]
        assert httpx.get(url + "/dashboard/api/slot/8").status_code == 404
