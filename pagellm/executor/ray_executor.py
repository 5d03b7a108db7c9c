"""Tensor-parallel ranks as Ray actors (``--distributed-executor-backend ray``).

Ray places the actors (on one node, or across a cluster the driver joined: ``RAY_ADDRESS`` or
``ray start``); rank 0's node address and a free port there form the process group's rendezvous.
Each step the pickled ``SchedulerOutput`` is put into Ray's object store once and every actor
reads it. A dead actor surfaces as Ray's actor error on its result, turned into
``WorkerDiedError``; the surviving actors are killed so none waits in a collective.

Ray is an optional dependency: ``pip install pagellm[ray]``.
"""
from __future__ import annotations

import logging
import pickle
import time
from typing import Any

from pagellm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagellm.executor.base import Executor, WorkerDiedError
from pagellm.executor.kv_tier import TierReportJoiner
from pagellm.executor.mp_executor import EXECUTE_TIMEOUT_S, READY_TIMEOUT_S
from pagellm.executor.worker import RankSpec, Worker, join_rank, rpc_results, serve_rpc
from pagellm.plan.resolved_config import ResolvedConfig

logger = logging.getLogger(__name__)


class RayRank:
    """The actor body: one rank (a Worker once ``init`` ran)."""

    def __init__(self) -> None:
        self.worker: Worker | None = None

    def rendezvous(self) -> str:
        """``tcp://ip:port`` on this actor's node, for the process group."""
        import socket

        import ray

        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((ip, 0))
            port = s.getsockname()[1]
        return f"tcp://{ip}:{port}"

    def init(self, rank: RankSpec, resolved: ResolvedConfig, eos_token_ids: set[int]) -> int:
        import os

        join_rank(resolved, rank)
        self.worker = Worker(resolved, rank.rank, eos_token_ids=eos_token_ids)
        return os.getpid()

    def execute(self, payload: bytes) -> Any:
        return self.worker.execute_and_time(pickle.loads(payload))

    def call(self, method: str, args: tuple) -> tuple[str, Any]:
        return serve_rpc(self.worker, method, args)


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ValueError("the ray executor needs Ray: pip install 'pagellm[ray]' (or pip install ray)") from None
    return ray


class RayExecutor(Executor):
    def __init__(
        self, resolved: ResolvedConfig, eos_token_ids: set[int], execute_timeout_s: float = EXECUTE_TIMEOUT_S
    ) -> None:
        ray = _import_ray()
        if not ray.is_initialized():
            ray.init(ignore_reinit_error=True, log_to_driver=True)
        self.ray = ray
        world_size = resolved.tensor_parallel_size
        self.world_size = world_size
        self.execute_timeout_s = execute_timeout_s
        self.last_timings: dict[str, float] = {}
        self._dead: str | None = None
        self.tier_joiner = TierReportJoiner(world_size)  # the ranks' offloading tier reports, as one
        gpus = 1 if resolved.device.type == "cuda" else 0
        actor_cls = ray.remote(num_cpus=0, num_gpus=gpus)(RayRank)
        self.actors = [actor_cls.remote() for _ in range(world_size)]
        try:
            init_method = ray.get(self.actors[0].rendezvous.remote(), timeout=READY_TIMEOUT_S)
            # One node's cores shared by its ranks (a multi-node cluster: set num_threads instead).
            threads = max(1, int(ray.available_resources().get("CPU", 1)) // world_size)
            ranks = [RankSpec(r, world_size, init_method, threads) for r in range(world_size)]
            eos = set(eos_token_ids)
            self.worker_pids = self._gather([a.init.remote(r, resolved, eos) for a, r in zip(self.actors, ranks)], READY_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise
        logger.info("tensor parallel: %d Ray actors ready (pids %s)", world_size, self.worker_pids)

    def _fail(self, message: str) -> WorkerDiedError:
        self._dead = message
        self._kill_all()
        logger.error("%s", message)
        return WorkerDiedError(message)

    def _gather(self, refs: list, timeout_s: float) -> list[Any]:
        """Every rank's result in rank order; the first failure (dead actor, error) fails them all."""
        ray = self.ray
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        pending = list(refs)
        deadline = time.monotonic() + timeout_s
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise self._fail(f"Ray ranks {sorted(rank_of[r] for r in pending)} did not answer within {timeout_s:.0f} s")
            ref = ready[0]
            try:
                results[rank_of[ref]] = ray.get(ref)
            except Exception as e:  # noqa: BLE001 - RayActorError, RayTaskError: the rank is gone or failed
                raise self._fail(f"tensor-parallel rank {rank_of[ref]} (Ray actor) failed: {e}") from None
        return results

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        if self._dead is not None:
            raise WorkerDiedError(self._dead)
        return rpc_results(self._gather([a.call.remote(method, args) for a in self.actors], self.execute_timeout_s))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self._dead is not None:
            raise WorkerDiedError(self._dead)
        payload = self.ray.put(pickle.dumps(scheduler_output, protocol=pickle.HIGHEST_PROTOCOL))
        replies = self._gather([a.execute.remote(payload) for a in self.actors], self.execute_timeout_s)
        output, timings = replies[0]
        self.tier_joiner.apply(output, replies[1:])
        self.last_timings = timings
        return output

    def check_health(self) -> None:
        if self._dead is not None:
            raise WorkerDiedError(self._dead)

    def _kill_all(self) -> None:
        for actor in getattr(self, "actors", []):
            try:
                self.ray.kill(actor)
            except Exception:  # noqa: BLE001 - already gone
                pass

    def shutdown(self) -> None:
        self._kill_all()
        self.actors = []
