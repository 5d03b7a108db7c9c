#!/usr/bin/env python
"""Soak test: mixed random traffic against a pagellm server, bounded in time and count, loopback only.

    python scripts/soak.py --duration-s 600 --max-requests 100000           # starts its own server
    python scripts/soak.py --url http://127.0.0.1:8000 --server-pid PID ...   # an already running one

Traffic: completions and chat, streamed or not, random n / max_tokens / stop / logprobs / seeds /
cache salts over prompts that share prefixes; some clients disconnect on purpose (mid-stream,
before the first byte, or by a short read timeout) and some send invalid requests (expecting 400).
Every answer is checked (OpenAI shapes, ``[DONE]``, one finish reason per choice) and greedy
requests must return the same text every time they are repeated.

Reported: requests served, outcomes, errors (any unexpected answer), the server's resident memory
(RSS from /proc/PID/status) at start, after warm-up and at the end, and, once idle, its KV cache
usage and running/waiting counts from /metrics (plus /debug/engine's integrity snapshot when the
server is the test suite's instrumented one). Exit status 0 only if there were no errors, the KV
cache is empty when idle and (when this script started the server) SIGTERM ended it with code 0.
"""
from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Optional
from urllib.parse import urlparse

import httpx

DEFAULT_API_KEY = "sk-soak"
# A small KV pool and a bounded queue, so preemption and overload answers are part of the soak;
# the exact float32 path, since greedy answers are checked against each prompt's answer alone
# (a preempted request's recomputation may round apart under int8 activations).
DEFAULT_SERVER_ARGS = [
    "--dtype", "float32",
    "--max-model-len", "256",
    "--num-kv-blocks", "32",
    "--max-num-seqs", "16",
    "--max-waiting-requests", "24",
    "--disable-uvicorn-access-log",
]
SYSTEM_PROMPTS = [
    "You are a concise assistant for a train company. Answer in one sentence.",
    "You are a friendly cooking tutor. Keep answers short and practical.",
    "You translate English into plain, simple English for young readers.",
]
TOPICS = ["the weather", "bread", "trains", "the moon", "a lost cat", "chess", "rivers", "a small town", "music", "the sea"]
STOPS = [".", "\n", " the", "!", ","]
BAD_BODIES = [
    ("/v1/completions", {"prompt": "x", "n": 0}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**6}),
    ("/v1/completions", {"prompt": [999999999]}),
    ("/v1/completions", {"prompt": "x", "logprobs": 99}),
    ("/v1/completions", {"prompt": "x", "stop": ["s"] * 100}),
    ("/v1/chat/completions", {"messages": []}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_k": 2**70, "temperature": 1}),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"99999999": 1}}),
]


@dataclass
class Report:
    duration_s: float = 0.0
    requests_sent: int = 0
    requests_served: int = 0  # answered 200 and read to the end
    outcomes: dict[str, int] = field(default_factory=dict)
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    greedy_repeats_checked: int = 0
    greedy_mismatches: int = 0
    rss_mib_start: Optional[float] = None
    rss_mib_after_warmup: Optional[float] = None
    rss_mib_end: Optional[float] = None
    rss_mib_peak: Optional[float] = None
    idle_kv_cache_usage_perc: Optional[float] = None
    idle_num_requests_running: Optional[float] = None
    idle_num_requests_waiting: Optional[float] = None
    num_preemptions: Optional[float] = None
    debug_engine_idle: Optional[dict] = None
    server_died: bool = False  # exited during the soak (a crash: the soak then stops early)
    server_exit_code: Optional[int] = None
    ok: bool = False


def rss_mib(pid: Optional[int]) -> Optional[float]:
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def metric(text: str, name: str) -> Optional[float]:
    match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else None


def require_loopback(url: str) -> None:
    host = urlparse(url).hostname or ""
    if host == "localhost":
        return
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass
    raise SystemExit(f"refusing to soak {url}: only loopback servers (127.0.0.1, ::1, localhost) are allowed")


class Soak:
    def __init__(self, args: argparse.Namespace, url: str, pid: Optional[int], proc: Optional[subprocess.Popen] = None) -> None:
        self.args = args
        self.proc = proc
        self.url = url
        self.pid = pid
        self.rng = random.Random(args.seed)
        self.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        self.report = Report()
        self.outcomes: Counter[str] = Counter()
        self.greedy: dict[str, list[str]] = {}
        self.deadline = 0.0

    # -- request generation -------------------------------------------------------------------------

    def make_request(self) -> tuple[str, dict, str]:
        """(path, body, plan) where plan is complete | disconnect_stream | disconnect_early | disconnect_timeout | bad."""
        rng = self.rng
        if rng.random() < self.args.bad_prob:
            path, body = rng.choice(BAD_BODIES)
            return path, dict(body), "bad"
        chat = rng.random() < 0.4
        greedy = rng.random() < 0.5
        system = rng.choice(SYSTEM_PROMPTS)
        if greedy:  # a small set, so that greedy requests repeat and can be compared
            question = f"Tell me something about {rng.choice(TOPICS)}"
            body: dict[str, Any] = {"max_tokens": rng.choice([8, 16, 32])}
        else:
            question = f"Tell me something about {rng.choice(TOPICS)} and {rng.choice(TOPICS)}"
            body = {"max_tokens": rng.randint(1, 48)}
        if chat:
            path = "/v1/chat/completions"
            body["messages"] = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        else:
            path = "/v1/completions"
            body["prompt"] = f"{system}\nQ: {question}\nA:"
        if greedy:
            body["temperature"] = 0
        else:
            body["temperature"] = rng.choice([0.7, 1.0])
            if rng.random() < 0.5:
                body["seed"] = rng.randint(0, 2**31)
        if rng.random() < 0.3:
            body["n"] = rng.randint(2, 3)
        if rng.random() < 0.3:
            body["stop"] = rng.sample(STOPS, rng.randint(1, 2))
        if rng.random() < 0.2:
            if chat:
                body["logprobs"], body["top_logprobs"] = True, rng.randint(0, 5)
            else:
                body["logprobs"] = rng.randint(0, 5)
        if rng.random() < 0.2:
            body["cache_salt"] = rng.choice(["tenant-1", "tenant-2"])
        body["stream"] = rng.random() < 0.5
        if body["stream"] and rng.random() < 0.3:
            body["stream_options"] = {"include_usage": True}
        plan = "complete"
        r = rng.random()
        if r < self.args.disconnect_prob:
            plan = rng.choice(["disconnect_stream", "disconnect_early", "disconnect_timeout"])
            if plan == "disconnect_stream":
                body["stream"], body["max_tokens"] = True, max(body["max_tokens"], 24)
                body.pop("stream_options", None)
        return path, body, plan

    # -- one request ----------------------------------------------------------------------------------

    async def run_one(self, client: httpx.AsyncClient) -> None:
        path, body, plan = self.make_request()
        self.report.requests_sent += 1
        try:
            outcome = await self._run(client, path, body, plan)
        except Exception as e:  # noqa: BLE001 - anything unplanned is an error of the server under test
            outcome = "error"
            self._error(f"{plan} {path}: {type(e).__name__}: {e}")
        self.outcomes[outcome] += 1
        if outcome == "overloaded_503":
            await asyncio.sleep(self.rng.uniform(0.5, 1.5))  # as clients should: back off for ~Retry-After (1 s)

    async def _run(self, client: httpx.AsyncClient, path: str, body: dict, plan: str) -> str:
        url = self.url + path
        if plan == "disconnect_early":
            return await self._disconnect_early(path, body)
        if plan == "disconnect_timeout":
            try:
                timeout = httpx.Timeout(30, read=self.rng.uniform(0.05, 1.0))
                await client.post(url, json={**body, "stream": False}, headers=self.headers, timeout=timeout)
            except httpx.ReadTimeout:
                return "disconnected"
            self.report.requests_served += 1  # it was quicker than the timeout (not checked further)
            return "served"
        if body.get("stream"):
            return await self._stream(client, url, path, body, plan)
        resp = await client.post(url, json=body, headers=self.headers, timeout=120)
        return self._check_plain(resp, path, body, plan)

    async def _disconnect_early(self, path: str, body: dict) -> str:
        host = urlparse(self.url)
        data = json.dumps(body).encode()
        auth = f"Authorization: {self.headers['Authorization']}\r\n" if self.headers else ""
        head = f"POST {path} HTTP/1.1\r\nHost: {host.netloc}\r\n{auth}Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
        reader, writer = await asyncio.open_connection(host.hostname, host.port)
        writer.write(head.encode() + data)
        await writer.drain()
        await asyncio.sleep(self.rng.uniform(0, 0.3))
        writer.close()
        return "disconnected"

    def _check_error_shape(self, status: int, payload: Any) -> None:
        err = payload.get("error") if isinstance(payload, dict) else None
        if not isinstance(err, dict) or set(err) != {"message", "type", "param", "code"} or err["code"] != status:
            raise AssertionError(f"error not in OpenAI's shape: {payload!r}"[:300])

    def _check_refusal(self, status: int, headers: Any, payload: Any, plan: str) -> Optional[str]:
        """Outcome for a non-200 answer that is expected, else None."""
        self._check_error_shape(status, payload)
        if plan == "bad" and status == 400:
            return "rejected_bad_input"
        if status == 503 and "overloaded" in payload["error"]["message"] and headers.get("retry-after"):
            return "overloaded_503"
        return None

    def _check_plain(self, resp: httpx.Response, path: str, body: dict, plan: str) -> str:
        if resp.status_code != 200:
            outcome = self._check_refusal(resp.status_code, resp.headers, resp.json(), plan)
            if outcome is None:
                raise AssertionError(f"unexpected {resp.status_code}: {resp.text[:300]}")
            return outcome
        if plan == "bad":
            raise AssertionError(f"invalid request accepted: {body}")
        data = resp.json()
        n = body.get("n", 1)
        choices = data["choices"]
        if sorted(c["index"] for c in choices) != list(range(n)) or any(c["finish_reason"] not in ("stop", "length") for c in choices):
            raise AssertionError(f"bad choices: {choices!r}"[:300])
        texts = [c["message"]["content"] if "message" in c else c["text"] for c in choices]
        self._check_greedy(path, body, texts)
        self.report.requests_served += 1
        return "served"

    async def _stream(self, client: httpx.AsyncClient, url: str, path: str, body: dict, plan: str) -> str:
        chat = path.endswith("chat/completions")
        n = body.get("n", 1)
        leave_after = self.rng.randint(1, 6) if plan == "disconnect_stream" else None
        texts: dict[int, str] = {}
        finish: dict[int, str] = {}
        done = False
        events = 0
        async with client.stream("POST", url, json=body, headers=self.headers, timeout=120) as resp:
            if resp.status_code != 200:
                payload = json.loads(await resp.aread())
                outcome = self._check_refusal(resp.status_code, resp.headers, payload, plan)
                if outcome is None:
                    raise AssertionError(f"unexpected {resp.status_code}: {payload!r}"[:300])
                return outcome
            if plan == "bad":
                raise AssertionError(f"invalid request accepted: {body}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    done = True
                    continue
                event = json.loads(data)
                if "error" in event:
                    raise AssertionError(f"in-band error: {event}"[:300])
                events += 1
                for c in event["choices"]:
                    piece = (c["delta"].get("content") or "") if chat else c["text"]
                    texts[c["index"]] = texts.get(c["index"], "") + piece
                    if c.get("finish_reason") is not None:
                        finish[c["index"]] = c["finish_reason"]
                if leave_after is not None and events >= leave_after:
                    return "disconnected"
        if not done or sorted(finish) != list(range(n)) or any(r not in ("stop", "length") for r in finish.values()):
            raise AssertionError(f"stream ended badly: done={done} finish={finish}")
        self._check_greedy(path, body, [texts.get(i, "") for i in range(n)])
        self.report.requests_served += 1
        return "served"

    def _check_greedy(self, path: str, body: dict, texts: list[str]) -> None:
        if body.get("temperature") != 0:
            return
        # All n samples of a greedy request are the same text...
        if len(set(texts)) != 1:
            self.report.greedy_mismatches += 1
            self._error(f"greedy samples differ: {texts!r}")
            return
        # ... and so is every repeat of it, whatever else was in the batch (streamed or not,
        # logprobs or not, preempted or not, prefix cached or not).
        key = json.dumps([path, body.get("prompt"), body.get("messages"), body["max_tokens"], body.get("stop"), body.get("cache_salt")])
        previous = self.greedy.setdefault(key, texts[0])
        if previous is not texts[0]:
            self.report.greedy_repeats_checked += 1
            if previous != texts[0]:
                self.report.greedy_mismatches += 1
                self._error(f"greedy output changed: {previous!r} then {texts[0]!r}")

    def _error(self, message: str) -> None:
        self.report.errors += 1
        if len(self.report.error_samples) < 20:
            self.report.error_samples.append(message[:400])

    # -- the run ----------------------------------------------------------------------------------------

    def keep_going(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            self.report.server_died = True
            return False
        return time.monotonic() < self.deadline and self.report.requests_sent < self.args.max_requests

    async def worker(self, client: httpx.AsyncClient) -> None:
        while self.keep_going():
            await self.run_one(client)

    async def sample_rss(self, warmup_at: float) -> None:
        while self.keep_going():
            rss = rss_mib(self.pid)
            if rss is not None:
                self.report.rss_mib_peak = max(self.report.rss_mib_peak or 0.0, rss)
                if self.report.rss_mib_after_warmup is None and time.monotonic() >= warmup_at:
                    self.report.rss_mib_after_warmup = rss
            await asyncio.sleep(1.0)

    async def run(self) -> Report:
        args = self.args
        self.report.rss_mib_start = rss_mib(self.pid)
        t0 = time.monotonic()
        self.deadline = t0 + args.duration_s
        warmup_at = t0 + min(args.warmup_s, args.duration_s / 2)
        limits = httpx.Limits(max_connections=args.concurrency * 2 + 4)
        async with httpx.AsyncClient(limits=limits, timeout=120) as client:
            sampler = asyncio.ensure_future(self.sample_rss(warmup_at))
            await asyncio.gather(*(self.worker(client) for _ in range(args.concurrency)))
            sampler.cancel()
        self.report.duration_s = round(time.monotonic() - t0, 1)
        if self.report.rss_mib_after_warmup is None:
            self.report.rss_mib_after_warmup = rss_mib(self.pid)
        try:
            await self.wait_idle()
        except httpx.HTTPError as e:
            self._error(f"the server did not answer after the soak: {type(e).__name__}: {e}")
        self.report.rss_mib_end = rss_mib(self.pid)
        self.report.outcomes = dict(self.outcomes)
        return self.report

    async def wait_idle(self, timeout_s: float = 120.0) -> None:
        """Waits for the server to hold no request, then records its KV usage and counters."""
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(timeout=30) as client:
            while True:
                text = (await client.get(self.url + "/metrics")).text
                running = metric(text, "pagellm:num_requests_running")
                waiting = metric(text, "pagellm:num_requests_waiting")
                usage = metric(text, "pagellm:kv_cache_usage_perc")
                if (running == 0 and waiting == 0 and usage == 0) or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.5)
            self.report.idle_kv_cache_usage_perc = usage
            self.report.idle_num_requests_running = running
            self.report.idle_num_requests_waiting = waiting
            self.report.num_preemptions = metric(text, "pagellm:num_preemptions_total")
            resp = await client.get(self.url + "/debug/engine")
            if resp.status_code == 200:  # only the test suite's instrumented server has it
                self.report.debug_engine_idle = resp.json()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str, Any]:
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix="pagellm-soak-server-", suffix=".log", delete=False)
    server_args = args.server_arg if args.server_arg else DEFAULT_SERVER_ARGS
    cmd = [sys.executable, "-m", "pagellm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port", str(port), *server_args]
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}; log: {log.name}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url, log
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise SystemExit(f"the server did not become healthy; log: {log.name}")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration-s", type=float, default=600.0, help="stop sending after this long (default 600)")
    p.add_argument("--max-requests", type=int, default=100_000, help="stop after this many requests (default 100000)")
    p.add_argument("--concurrency", type=int, default=24, help="clients in flight at once (default 24)")
    p.add_argument("--warmup-s", type=float, default=60.0, help="RSS 'after warm-up' is read this long into the run")
    p.add_argument("--disconnect-prob", type=float, default=0.15)
    p.add_argument("--bad-prob", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--url", default=None, help="soak this running server (loopback only) instead of starting one")
    p.add_argument("--server-pid", type=int, default=None, help="its pid, for RSS (default: the started server's)")
    p.add_argument("--api-key", default=DEFAULT_API_KEY)
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="a flag for the started server (repeat); default: %s" % " ".join(DEFAULT_SERVER_ARGS),
    )
    p.add_argument("--json-out", default=None, help="also write the report as JSON here")
    args = p.parse_args(argv)
    if args.duration_s <= 0 or args.max_requests < 1 or args.concurrency < 1:
        p.error("--duration-s, --max-requests and --concurrency must be positive")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    proc = log = None
    if args.url:
        url, pid = args.url.rstrip("/"), args.server_pid
    else:
        proc, url, log = start_server(args)
        pid = proc.pid
        print(f"started a server at {url} (pid {pid}, log {log.name})", flush=True)
    require_loopback(url)
    report = asyncio.run(Soak(args, url, pid, proc).run())
    if proc is not None:
        proc.send_signal(signal.SIGTERM)
        try:
            report.server_exit_code = proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            report.server_exit_code = proc.wait(10)
    report.ok = (
        report.errors == 0
        and report.idle_kv_cache_usage_perc == 0
        and report.idle_num_requests_running == 0
        and (proc is None or report.server_exit_code == 0)
    )
    out = json.dumps(asdict(report), indent=2)
    print(out)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(out + "\n")
    if log is not None and report.ok:
        os.unlink(log.name)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
