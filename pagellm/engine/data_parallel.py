"""Data parallelism: N engine replicas behind one front end, each request routed by prefix.

``DPAsyncLLM`` holds N ``AsyncLLM``s (each its own engine thread, model copy, KV cache and
scheduler) and offers the one ``AsyncLLM``'s interface to the server. ``PrefixAwareRouter`` keeps
a router-side index of the block hashes (the same chained SHA-256 as the prefix cache's) it sent
to each replica; a request goes to the replica that holds the longest run of its leading blocks,
ties (a new prefix) to the replica with the fewest requests in flight, then the lowest index. The
index is a bounded LRU per replica, so it forgets what the replica's cache probably evicted too.

Replicas here share one process: torch releases the GIL in its kernels, and each engine thread
gets ``num_threads`` cores (its own OpenMP pool). Tokenization for routing uses a second
tokenizer instance, so it never runs on an engine thread.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
from collections import OrderedDict
from typing import Any, Callable, Optional, Union

from pagellm.config import EngineConfig
from pagellm.core.block_hash import BlockHash, hash_full_blocks
from pagellm.engine.async_llm import AsyncLLM, LazyPrompt
from pagellm.engine.request_stream import RequestStream, StreamingFrontEnd
from pagellm.lora.request import LoRARequest
from pagellm.outputs import RequestOutput
from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

OWNER_MEMORY = 1 << 16  # request ids remembered for aborts; an unknown id's abort goes to every replica


class PrefixAwareRouter:
    def __init__(self, num_replicas: int, block_size: int, max_blocks_per_replica: int = 1 << 16) -> None:
        if num_replicas < 1:
            raise ValueError(f"data_parallel_size must be positive, got {num_replicas}")
        self.num_replicas = num_replicas
        self.block_size = block_size
        self.max_blocks = max_blocks_per_replica
        self.index: list[OrderedDict[BlockHash, None]] = [OrderedDict() for _ in range(num_replicas)]
        self.routed = [0] * num_replicas
        self._lock = threading.Lock()

    def block_hashes(self, token_ids: list[int], cache_salt: Optional[str] = None) -> list[BlockHash]:
        return hash_full_blocks(token_ids, self.block_size, cache_salt)

    def _match(self, replica: int, hashes: list[BlockHash]) -> int:
        index, n = self.index[replica], 0
        for h in hashes:
            if h not in index:
                break
            n += 1
        return n

    def choose(self, token_ids: list[int], cache_salt: Optional[str] = None, loads: Optional[list[int]] = None) -> int:
        """The replica for a request: the longest indexed prefix, then the least ``loads`` (requests
        in flight per replica), then the lowest index. Its blocks are then indexed there."""
        hashes = self.block_hashes(token_ids, cache_salt)
        loads = loads if loads is not None else [0] * self.num_replicas
        with self._lock:
            best = max(range(self.num_replicas), key=lambda r: (self._match(r, hashes), -loads[r], -r))
            index = self.index[best]
            for h in hashes:
                index[h] = None
                index.move_to_end(h)
            while len(index) > self.max_blocks:
                index.popitem(last=False)
            self.routed[best] += 1
        return best


class _ReplicaStatLogger:
    """Feeds one replica's stats into the server's summed metrics and its own ``replica``-labelled gauges."""

    def __init__(self, dp: "DPAsyncLLM", metrics: Any, replica: int, gauges: dict) -> None:
        self.dp, self.metrics, self.replica, self.gauges = dp, metrics, replica, gauges
        self._seen = (0, 0, 0)

    def record_step(self, stats, now: float) -> None:
        s = stats.scheduler
        m = self.metrics
        q, h, p = self._seen
        m.prefix_cache_queries.inc(s.prefix_cache_queries - q)
        m.prefix_cache_hits.inc(s.prefix_cache_hits - h)
        m.num_preemptions.inc(s.num_preemptions - p)
        self._seen = (s.prefix_cache_queries, s.prefix_cache_hits, s.num_preemptions)
        r = str(self.replica)
        self.gauges["running"].labels(r).set(s.num_running_reqs)
        self.gauges["waiting"].labels(r).set(s.num_waiting_reqs)
        self.gauges["kv"].labels(r).set(s.kv_cache_usage)
        self.gauges["hits"].labels(r).set(s.prefix_cache_hits)
        self.dp._replica_gauges[self.replica] = (s.num_running_reqs, s.num_waiting_reqs, s.kv_cache_usage)
        running, waiting, kv = (sum(v) for v in zip(*self.dp._replica_gauges))
        m.num_requests_running.set(running)
        m.num_requests_waiting.set(waiting)
        m.kv_cache_usage.set(kv / self.dp.num_replicas)

    def record_output(self, output: RequestOutput, now: float, inter_token_latency: Optional[float]) -> None:
        self.metrics.record_output(output, now, inter_token_latency)

    def record_aborted(self, num_requests: int) -> None:
        self.metrics.record_aborted(num_requests)


class DPAsyncLLM(StreamingFrontEnd):
    """``AsyncLLM``'s interface over N replicas (see the module docstring)."""

    def __init__(self, replicas: list[AsyncLLM], tokenizer_factory: Optional[Callable[[], Any]] = None) -> None:
        self.replicas = replicas
        self.num_replicas = len(replicas)
        first = replicas[0]
        self.router = PrefixAwareRouter(self.num_replicas, first.engine.config.block_size)
        # A tokenizer of its own for routing (the engines' belong to their threads).
        self._route_tokenizer = tokenizer_factory() if tokenizer_factory is not None else None
        self._owner: OrderedDict[str, int] = OrderedDict()  # request id -> replica, for aborts (bounded)
        self._replica_gauges = [(0, 0, 0.0)] * self.num_replicas
        self._stat_logger = None

    def wait_until_built(self) -> Any:
        """The first replica's engine: the replicas are built by :meth:`from_config`."""
        return self.engine

    @classmethod
    def from_config(cls, config: EngineConfig, data_parallel_size: int) -> "DPAsyncLLM":
        from pagellm.tokenizer import load_tokenizer

        replicas = []
        try:
            for i in range(data_parallel_size):
                c = config
                if config.num_threads is None and config.device.type == "cpu":
                    c = dataclasses.replace(config, num_threads=max(1, len(os.sched_getaffinity(0)) // data_parallel_size))
                replicas.append(AsyncLLM.from_config(c))
                logger.info("data parallel: replica %d/%d ready", i + 1, data_parallel_size)
        except BaseException:
            for r in replicas:
                r.shutdown()
            raise
        path = replicas[0].engine.model_path
        return cls(replicas, lambda: load_tokenizer(config.tokenizer or path))

    # -- what the server reads ---------------------------------------------------------------------

    @property
    def engine(self):
        return self.replicas[0].engine

    @property
    def tokenizer(self):
        return self.replicas[0].tokenizer

    @property
    def model_name(self) -> str:
        return self.replicas[0].model_name

    @property
    def max_model_len(self) -> int:
        return min(r.max_model_len for r in self.replicas)

    @property
    def is_dead(self) -> bool:
        return any(r.is_dead for r in self.replicas)

    @property
    def dead_error(self) -> Optional[BaseException]:
        return next((r.dead_error for r in self.replicas if r.is_dead), None)

    @property
    def num_in_flight(self) -> int:
        return sum(r.num_in_flight for r in self.replicas)

    @property
    def stat_logger(self):
        return self._stat_logger

    @stat_logger.setter
    def stat_logger(self, metrics) -> None:
        """The server's metrics: summed over replicas, plus per-replica gauges labelled ``replica``."""
        from prometheus_client import Gauge

        self._stat_logger = metrics
        reg = metrics.registry
        gauges = {
            "running": Gauge("pagellm:dp_num_requests_running", "Requests running, per data-parallel replica.", ["replica"], registry=reg),
            "waiting": Gauge("pagellm:dp_num_requests_waiting", "Requests waiting, per data-parallel replica.", ["replica"], registry=reg),
            "kv": Gauge("pagellm:dp_kv_cache_usage_perc", "KV-cache usage, per data-parallel replica.", ["replica"], registry=reg),
            "hits": Gauge("pagellm:dp_prefix_cache_hits", "Prefix-cache hit tokens so far, per replica.", ["replica"], registry=reg),
        }
        for i, replica in enumerate(self.replicas):
            for gauge in gauges.values():
                gauge.labels(str(i)).set(0)  # every replica shows from the start, busy or not
            replica.stat_logger = _ReplicaStatLogger(self, metrics, i, gauges)

    # -- requests ----------------------------------------------------------------------------------

    def _route_tokens(self, prompt: Any) -> list[int]:
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        text = prompt.get("prompt", "") if isinstance(prompt, dict) else prompt
        if self._route_tokenizer is None or not isinstance(text, str):
            return []
        return self._route_tokenizer.encode(text, add_special_tokens=True)

    async def add_request(
        self,
        request_id: str,
        prompt: LazyPrompt,
        params: SamplingParams | PoolingParams,
        arrival_time: Optional[float] = None,
        lora_request: Optional[LoRARequest] = None,
    ) -> RequestStream:
        def resolve() -> tuple[Any, list[int]]:
            # Off the event loop: a chat template's rendering, and tokenizing for the router.
            resolved = prompt() if callable(prompt) else prompt
            return resolved, self._route_tokens(resolved)

        resolved, tokens = await asyncio.to_thread(resolve)
        salt = resolved.get("cache_salt") if isinstance(resolved, dict) else None
        replica = self.router.choose(tokens, salt, [r.num_in_flight for r in self.replicas])
        self._owner[request_id] = replica
        while len(self._owner) > OWNER_MEMORY:
            self._owner.popitem(last=False)
        return await self.replicas[replica].add_request(request_id, resolved, params, arrival_time, lora_request)

    def abort(self, request_id: Union[str, list[str]]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            replica = self._owner.get(rid)
            targets = [self.replicas[replica]] if replica is not None else self.replicas
            for r in targets:
                r.abort(rid)

    def abort_all(self) -> None:
        for r in self.replicas:
            r.abort_all()

    async def run_in_engine(self, fn):
        """On replica 0 (tokenization, the dashboard's view)."""
        return await self.replicas[0].run_in_engine(fn)

    def shutdown(self, timeout: float = 5.0) -> None:
        for r in self.replicas:
            r.shutdown(timeout)

