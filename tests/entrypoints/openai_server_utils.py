"""A real ``pagellm`` server in a subprocess, on a free loopback port."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Optional

import httpx

API_KEY = "sk-pagellm-test"
# Small budgets keep the server light on a shared 2-core machine: 512-token context, ~1.1k KV tokens.
SERVER_ARGS = [
    "--max-model-len", "512",
    "--kv-cache-memory", "48MiB",
    "--max-num-seqs", "32",
    "--no-enable-prefix-caching",
    "--api-key", API_KEY,
    "--disable-uvicorn-access-log",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteServer:
    """``pagellm serve`` (or the api_server module) as a child process."""

    def __init__(self, args: list[str], use_cli: bool = False, startup_timeout_s: float = 240.0, env: Optional[dict] = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="pagellm-server-", suffix=".log", delete=False)
        entry = ["-m", "pagellm.cli", "serve"] if use_cli else ["-m", "pagellm.entrypoints.openai.api_server"]
        self._launch([sys.executable, *entry, "--host", "127.0.0.1", "--port", str(self.port), *args], env, startup_timeout_s)

    def _launch(self, cmd: list[str], env: Optional[dict], startup_timeout_s: float) -> None:
        t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        self._wait_healthy(startup_timeout_s)
        self.startup_s = time.monotonic() - t0

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.read_log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"server not healthy after {timeout_s} s:\n{self.read_log()}")

    def read_log(self) -> str:
        with open(self.log.name) as f:
            return f.read()

    def openai_client(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0, **kwargs)

    def async_openai_client(self, **kwargs):
        import openai

        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0, **kwargs)

    def terminate(self, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def stop_and_check(self) -> None:
        """Shuts the server down (as SIGTERM does) and asserts it exited cleanly, with its log as the message."""
        exit_code = self.terminate()
        log = self.read_log()
        self.cleanup()
        assert exit_code == 0, log

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def cleanup(self) -> None:
        """Kills the server if still running and removes its log."""
        self.kill()
        try:
            os.unlink(self.log.name)
        except OSError:
            pass


class HealthWatcher:
    """Polls a server's /health from a thread and keeps every status seen, to show a dying server
    going from 200 to 503. Bounded: it stops when told, when the server exits, or after 2000 probes."""

    def __init__(self, server: RemoteServer) -> None:
        self.server = server
        self.statuses: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def start(self) -> "HealthWatcher":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def _watch(self) -> None:
        for _ in range(2000):
            if self._stop.is_set():
                return
            try:
                self.statuses.append(httpx.get(f"{self.server.url}/health", timeout=5).status_code)
            except httpx.HTTPError:
                if self.server.proc.poll() is not None:
                    return
            time.sleep(0.02)


THINKING_TEMPLATE = os.path.join(os.path.dirname(__file__), "data", "thinking_chatml.jinja")


def thinking_llama_args(path) -> list[str]:
    """Saves a tiny random Llama (SmolLM2's vocabulary, seeded) at ``path``; returns the serve flags
    for it with SmolLM2's tokenizer, a chat template that opens ``<think>`` and ``--reasoning-parser qwen3``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagellm.models.loader import default_model_path

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    return [str(path), "--tokenizer", default_model_path(), "--chat-template", THINKING_TEMPLATE, "--reasoning-parser", "qwen3"]
