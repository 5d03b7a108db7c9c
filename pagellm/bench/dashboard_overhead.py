"""Throughput of `pagellm serve` on workload R with and without a /dashboard stream open, in turns.

    python -m pagellm.bench.dashboard_overhead [OUT_DIR] [--turns 2]

Starts one server (defaults, access log off), warms it up, then runs `pagellm bench serve` on
workload R (64 prompts x 256 random tokens in, 128 out, 32 in flight, all at once, ignore_eos)
alternately without and with an SSE client reading /dashboard/events in another process (the
stand-in for an open page: it polls the engine exactly as a browser's stream does). Prints a
table and writes OUT_DIR/summary.json (default /tmp/dashboard_overhead).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx

R_ARGS = [
    "--dataset-name", "random", "--random-input-len", "256", "--random-output-len", "128",
    "--num-prompts", "64", "--max-concurrency", "32", "--disable-tqdm",
]
SSE_READER = r"""
import sys, time, httpx
url = sys.argv[1]
n = size = 0
t0 = time.monotonic()
try:
    with httpx.stream("GET", url + "/dashboard/events", timeout=None) as r:
        for line in r.iter_lines():
            size += len(line) + 1
            n += line.startswith("event: ")
except (KeyboardInterrupt, httpx.HTTPError):
    pass
finally:
    print(f"sse: {n} events, {size / 1e6:.2f} MB in {time.monotonic() - t0:.0f} s", flush=True)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_r(url: str, out_dir: str, name: str, seed: int, num_prompts: int = 64) -> dict:
    # A new seed per run: the same prompts again would be served from the prefix cache.
    args = [*R_ARGS, "--seed", str(seed)]
    args[args.index("--num-prompts") + 1] = str(num_prompts)
    cmd = [sys.executable, "-m", "pagellm.cli", "--log-level", "warning", "bench", "serve", "--base-url", url, *args,
           "--save-result", "--result-dir", out_dir, "--result-filename", f"{name}.json"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(out_dir, f"{name}.json")) as f:
        return json.load(f)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir", nargs="?", default="/tmp/dashboard_overhead")
    parser.add_argument("--turns", type=int, default=2)
    args = parser.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(os.path.join(args.out_dir, "server.log"), "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "pagellm.cli", "serve", "--port", str(port), "--disable-uvicorn-access-log"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError("server did not start; see server.log")
            time.sleep(0.5)
        run_r(url, args.out_dir, "warmup", seed=1000, num_prompts=32)
        rows = []
        for turn in range(args.turns):
            for with_page in (False, True):
                name = f"turn{turn + 1}-{'page' if with_page else 'nopage'}"
                reader = None
                if with_page:
                    reader = subprocess.Popen([sys.executable, "-c", SSE_READER, url], stdout=subprocess.PIPE, text=True)
                    time.sleep(1.0)  # connected, full snapshot sent
                cost0 = httpx.get(url + "/dashboard/api/cost").json()
                result = run_r(url, args.out_dir, name, seed=len(rows) + 1)
                cost1 = httpx.get(url + "/dashboard/api/cost").json()
                sse = ""
                if reader is not None:
                    reader.send_signal(signal.SIGINT)
                    sse = reader.communicate(timeout=30)[0].strip()
                # The dashboard's own time during the run, as shares of the run's wall time.
                engine_share = (cost1["engine_s"] - cost0["engine_s"]) / result["duration"]
                loop_share = (cost1["loop_s"] - cost0["loop_s"]) / result["duration"]
                polls = cost1["polls"] - cost0["polls"]
                row = {
                    "run": name,
                    "page_open": with_page,
                    "output_throughput": result["output_throughput"],
                    "duration_s": result["duration"],
                    "mean_ttft_ms": result["mean_ttft_ms"],
                    "mean_tpot_ms": result["mean_tpot_ms"],
                    "sse": sse,
                    "dashboard_polls": polls,
                    "dashboard_engine_thread_share": engine_share,
                    "dashboard_event_loop_share": loop_share,
                }
                rows.append(row)
                print(f"{name:<14} {row['output_throughput']:8.1f} output tok/s  {row['duration_s']:6.1f} s  "
                      f"TTFT {row['mean_ttft_ms']:7.0f} ms  TPOT {row['mean_tpot_ms']:6.1f} ms  "
                      f"dashboard: {polls} polls, engine thread {100 * engine_share:.3f}%, event loop {100 * loop_share:.3f}%  {sse}",
                      flush=True)
        off = [r["output_throughput"] for r in rows if not r["page_open"]]
        on = [r["output_throughput"] for r in rows if r["page_open"]]
        mean_off, mean_on = sum(off) / len(off), sum(on) / len(on)
        summary = {"rows": rows, "mean_off": mean_off, "mean_on": mean_on, "change": mean_on / mean_off - 1,
                   "load_average_after": os.getloadavg()}
        print(f"mean without page {mean_off:.1f}, with page {mean_on:.1f} output tok/s: {100 * summary['change']:+.2f}%")
        with open(os.path.join(args.out_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
