"""A one-minute run of scripts/soak.py (the full run is ten minutes; see docs/reliability.md)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile

import pytest
from reliability_utils import API_KEY, start_server

pytestmark = pytest.mark.slow

SOAK = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "scripts", "soak.py")


def load_soak_module():
    spec = importlib.util.spec_from_file_location("pagellm_soak_script", SOAK)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_soak_refuses_non_loopback_servers():
    soak = load_soak_module()
    for url in ("http://127.0.0.1:8000", "http://localhost:1", "http://[::1]:80"):
        soak.require_loopback(url)
    for url in ("http://10.0.0.1:8000", "http://example.com", "http://0.0.0.0:8000"):
        with pytest.raises(SystemExit, match="only loopback"):
            soak.require_loopback(url)


def test_one_minute_soak_serves_everything_and_leaks_nothing():
    soak = load_soak_module()
    server = start_server(soak.DEFAULT_SERVER_ARGS + ["--api-key", API_KEY])
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "soak.json")
            cmd = [sys.executable, SOAK, "--url", server.url, "--server-pid", str(server.pid), "--api-key", API_KEY,
                   "--duration-s", "60", "--max-requests", "3000", "--warmup-s", "15", "--json-out", out]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            assert os.path.exists(out), proc.stdout[-3000:] + proc.stderr[-3000:]
            with open(out) as f:
                report = json.load(f)
        server.assert_pool_whole()
        code = server.terminate()
        assert code == 0, server.read_log()
    finally:
        server.cleanup()
    assert proc.returncode == 0 and report["ok"], report
    assert report["errors"] == 0 and report["greedy_mismatches"] == 0, report["error_samples"]
    assert report["requests_served"] >= 50 and report["outcomes"].get("disconnected", 0) > 0, report
    assert report["idle_kv_cache_usage_perc"] == 0 and report["idle_num_requests_running"] == 0
    snap = report["debug_engine_idle"]
    assert snap["num_used_blocks"] == 0 and snap["num_free_blocks"] == snap["num_blocks"] and snap["num_streams"] == 0
    # Resident memory settles after warm-up (generous: caches may still fill a little).
    assert report["rss_mib_end"] < report["rss_mib_after_warmup"] + 256, report
