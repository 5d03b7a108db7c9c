"""/dashboard in a real headless browser (Debian's chromium through playwright) on the real model.

A burst of requests sharing a ~200-token prefix runs while the page is open; the test waits for
shared blocks to show, checks that the cells drawn on the canvas, the legend and the pool's own
counters agree with each other and with ``/metrics``, hovers a block, and saves a screenshot
(its path is printed; ``PAGELLM_DASHBOARD_SCREENSHOT=docs/dashboard.png`` also writes it there).
"""
from __future__ import annotations

import os
import re
import shutil
import threading

import httpx
import pytest
from openai_server_utils import API_KEY, RemoteServer

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
]
SERVER_ARGS = [
    "--max-model-len", "1024",
    "--kv-cache-memory", "512MiB",
    "--max-num-seqs", "32",
    "--api-key", API_KEY,
    "--dashboard-show-text",
    "--disable-uvicorn-access-log",
]
AUTH = {"Authorization": f"Bearer {API_KEY}"}
NUM_REQUESTS = 16
MAX_TOKENS = 160

playwright_sync = pytest.importorskip("playwright.sync_api")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="needs Debian's chromium (scripts/setup.sh installs it)"),
]

# The page's drawn cells, counted by the colour of each cell's top-left pixel (outside any digit).
COUNT_DRAWN_JS = """() => {
  const S = window.dashboard, c = document.getElementById('map');
  const g = c.getContext('2d'), dpr = window.devicePixelRatio || 1;
  const img = g.getImageData(0, 0, c.width, c.height).data;
  const rgb = (hex) => [1, 3, 5].map((k) => parseInt(hex.slice(k, k + 2), 16)).join(',');
  const byColour = {[rgb('#e6e9ee')]: 'free', [rgb('#9ecae1')]: 'cached', [rgb('#41ab5d')]: 'used'};
  const out = {free: 0, cached: 0, used: 0, shared: 0};
  for (let i = 0; i < S.numBlocks; i++) {
    const x = Math.floor(((i % S.cols) * S.cell + 1) * dpr), y = Math.floor((Math.floor(i / S.cols) * S.cell + 1) * dpr);
    const k = (y * c.width + x) * 4;
    out[byColour[[img[k], img[k + 1], img[k + 2]].join(',')] || 'shared']++;
  }
  return out;
}"""

READ_LEGEND_JS = """() => {
  const t = (id) => Number(document.getElementById(id).textContent);
  return {free: t('count-free'), cached: t('count-cached'), used: t('count-used'), shared: t('count-shared'),
          engine_used: t('engine-used'), version: Number(document.body.dataset.version)};
}"""


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} ([0-9.e+-]+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer(SERVER_ARGS)
    yield srv
    code = srv.terminate()
    log = srv.read_log()
    srv.cleanup()
    assert code == 0, log  # an open dashboard stream must not hold up the drain


def send_burst(url: str, results: list) -> list[threading.Thread]:
    prefix = "The paged KV cache stores keys and values in fixed-size blocks. " * 16  # ~200 tokens

    def one(i: int) -> None:
        body = {"prompt": prefix + f"Question {i}: what is block {i}?", "max_tokens": MAX_TOKENS, "ignore_eos": True}
        results.append(httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=600).status_code)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(NUM_REQUESTS)]
    for t in threads:
        t.start()
    return threads


def test_dashboard_shows_shared_blocks_matching_metrics(server, tmp_path):
    # A finished request first: its blocks stay in the prefix cache (cached, in the LRU).
    earlier = {"prompt": "An earlier, unrelated request about fixed-size pages of memory. " * 6, "max_tokens": 1}
    assert httpx.post(f"{server.url}/v1/completions", json=earlier, headers=AUTH, timeout=300).status_code == 200
    results: list[int] = []
    threads = send_burst(server.url, results)
    with playwright_sync.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1050})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"{server.url}/dashboard?key={API_KEY}")  # sets the cookie, redirects to /dashboard
            assert page.url.endswith("/dashboard")
            page.wait_for_function("window.dashboard && window.dashboard.counts.shared > 0", timeout=120_000)
            num_blocks = page.evaluate("window.dashboard.numBlocks")

            # Drawn cells == legend == the pool's counter sent in the same engine step.
            # One evaluation reads both: an update between two evaluations would redraw in between.
            legend, drawn = page.evaluate(f"[({READ_LEGEND_JS})(), ({COUNT_DRAWN_JS})()]")
            assert {k: legend[k] for k in drawn} == drawn
            assert legend["used"] + legend["shared"] == legend["engine_used"]
            assert sum(drawn.values()) == num_blocks and drawn["cached"] > 0
            # ... and /metrics, read between two looks at the page: blocks are only taken while
            # the burst grows, so the gauge's used blocks lie between the two.
            before = page.evaluate(READ_LEGEND_JS)
            usage = metric(httpx.get(f"{server.url}/metrics").text, "pagellm:kv_cache_usage_perc")
            page.wait_for_timeout(1200)
            after = page.evaluate(READ_LEGEND_JS)
            assert before["engine_used"] <= round(usage * num_blocks) <= after["engine_used"], (before, usage, after)

            # Hover a shared block: its owners, hash prefix and (with --dashboard-show-text) its text.
            shared_id = page.evaluate("Array.from(window.dashboard.codes).findIndex((c) => c >= 3)")
            box = page.locator("#map").bounding_box()
            cell, cols = page.evaluate("[window.dashboard.cell, window.dashboard.cols]")
            page.mouse.move(box["x"] + (shared_id % cols + 0.5) * cell, box["y"] + (shared_id // cols + 0.5) * cell)
            page.wait_for_function("document.getElementById('tip').textContent.includes('hash:')", timeout=10_000)
            tip = page.inner_text("#tip")
            assert f"#{shared_id}" in tip and "shared" in tip and "text:" in tip and "requests:" in tip, tip

            all_running = f"window.dashboard.requests.filter((r) => r.queue === 'running').length === {NUM_REQUESTS}"
            page.wait_for_function(all_running, timeout=60_000)
            page.wait_for_function("window.dashboard.events > 8")  # a few updates, and chart points
            shot = tmp_path / "dashboard.png"
            page.screenshot(path=str(shot), full_page=True)
            print(f"\ndashboard screenshot: {shot}")
            if os.environ.get("PAGELLM_DASHBOARD_SCREENSHOT"):
                shutil.copy(shot, os.environ["PAGELLM_DASHBOARD_SCREENSHOT"])

            for t in threads:
                t.join(600)
            assert results == [200] * NUM_REQUESTS
            # Settled: nothing in use, on the page and on /metrics; the prefix stays cached.
            page.wait_for_function("window.dashboard.counts.engine_used === 0 && window.dashboard.requests.length === 0", timeout=30_000)
            legend = page.evaluate(READ_LEGEND_JS)
            assert legend["used"] == legend["shared"] == 0 and legend["cached"] > 0
            assert page.evaluate(COUNT_DRAWN_JS) == {k: legend[k] for k in ("free", "cached", "used", "shared")}
            assert metric(httpx.get(f"{server.url}/metrics").text, "pagellm:kv_cache_usage_perc") == 0.0

            # Scale: a synthetic map of 131072 blocks draws in one canvas, fast.
            page.evaluate("window.dashboard.source.close()")
            ms = page.evaluate("""() => {
              const n = 131072, codes = new Uint8Array(n);
              for (let i = 0; i < n; i++) codes[i] = [0, 0, 1, 2, 2, 3, 5][i % 7];
              let bin = ''; for (let i = 0; i < n; i++) bin += String.fromCharCode(codes[i]);
              window.dashboard.applyFull({v: 0, num_blocks: n, block_size: 16, show_text: false, codes: btoa(bin),
                tables: {}, requests: [], counts: {free: 0, cached: 0, used: 0, shared: 0, engine_used: 0, engine_free: 0}});
              return window.dashboard.lastDrawMs;
            }""")
            print(f"131072-block map drawn in {ms:.0f} ms")
            assert ms < 1000
            assert page.evaluate("document.querySelectorAll('#map-wrap canvas').length") == 1

            # A hybrid model: each request's tables in every KV cache group, labelled by window.
            page.evaluate("""() => {
              const counts = {free: 5, cached: 0, used: 3, shared: 0, engine_used: 3, engine_free: 5};
              window.dashboard.applyFull({v: 0, num_blocks: 8, block_size: 16, show_text: false,
                codes: btoa('\\x00\\x02\\x02\\x02\\x00\\x00\\x00\\x00'), tables: {r1: [1, 2]},
                groups: [{window: null, layers: [0]}, {window: 512, layers: [1]}], group_tables: {'1': {r1: [0, 3]}},
                requests: [{id: 'r1', queue: 'running', status: 'running', prompt: 20, output: 1, computed: 20, preemptions: 0}],
                counts});
              window.dashboard.applyDiff({v: 1, group_tables: {'1': {r1: [2, 4]}}, counts});
            }""")
            page.wait_for_function("document.querySelectorAll('#running .group-row').length === 2", timeout=10_000)
            labels = page.evaluate("Array.from(document.querySelectorAll('#running .group-label')).map((e) => e.textContent)")
            assert labels == ["full", "W512"]
            assert page.evaluate("window.dashboard.groupTables.get('1').get('r1')") == [0, 3, 4]
            assert not errors, errors
        finally:
            browser.close()
