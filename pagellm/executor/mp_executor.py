"""Tensor-parallel ranks as local processes (``--distributed-executor-backend mp``).

Each step the driver pickles the ``SchedulerOutput`` once and writes it to every rank's pipe;
all ranks reply (rank 0 with its sampled tokens). The driver waits on the pipes and on the
processes' sentinels together, so a rank that dies (killed, crashed, out of memory) is noticed
at once, not after a collective's timeout: the other ranks are killed and the step raises
``WorkerDiedError``, which kills the engine cleanly (the server answers 503 and exits 1). A
rank that stops answering without dying fails the step after ``execute_timeout_s``. Ranks die
with the driver (PR_SET_PDEATHSIG on Linux), even when it leaves through ``os._exit``.

Ranks are spawned, not forked (a fork would copy the driver's threads' locks and OpenMP pool
mid-use), but without re-running the user's script: spawned processes normally import
``__main__`` again, and a script that builds ``LLM(tensor_parallel_size=2)`` at its top level,
with no ``if __name__ == "__main__":`` guard, would start an engine in every rank. A rank needs
only pagellm's modules, so ``__main__`` is hidden from multiprocessing while the ranks start.
"""
from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import pickle
import signal
import socket
import sys
import time
import traceback
from collections.abc import Iterator
from multiprocessing.connection import Connection, wait
from typing import Any

from pagellm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagellm.executor.base import Executor, WorkerDiedError
from pagellm.executor.kv_tier import TierReportJoiner
from pagellm.executor.worker import RankSpec, Worker, join_rank, rank_cpus, rpc_results, serve_rpc
from pagellm.plan.resolved_config import ResolvedConfig

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 600.0
EXECUTE_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _main_not_reimported() -> Iterator[None]:
    """While processes start: ``__main__`` with no ``__spec__`` name and no ``__file__``, which is
    how multiprocessing's spawn decides to import the main script (by module name or path) in the child."""
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    saved = {name: main.__dict__[name] for name in ("__file__", "__spec__") if name in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


def _die_with_parent() -> None:
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _worker_main(rank: RankSpec, resolved: ResolvedConfig, eos_token_ids: set[int], conn: Connection) -> None:
    _die_with_parent()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s rank{rank.rank} %(name)s: %(message)s")
    try:
        join_rank(resolved, rank)
        worker = Worker(resolved, rank.rank, eos_token_ids=eos_token_ids)
        conn.send(("ready", os.getpid()))
    except BaseException:  # noqa: BLE001 - reported to the driver, which raises it
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            kind, payload = conn.recv()
        except (EOFError, OSError):
            break  # the driver is gone
        if kind == "shutdown":
            break
        try:
            if kind == "exec":
                reply = worker.execute_and_time(pickle.loads(payload))
            else:
                reply = serve_rpc(worker, *payload)
            conn.send(("ok", reply))
        except BaseException:  # noqa: BLE001
            try:
                conn.send(("error", traceback.format_exc()))
            except OSError:
                pass
            break
    from pagellm.distributed.parallel_state import destroy_tensor_parallel
    from pagellm.kernels import pack_cache

    try:
        destroy_tensor_parallel()
    except Exception:  # noqa: BLE001 - exiting anyway
        pass
    pack_cache.wait_for_writes(timeout_s=4.0)  # within the driver's 5 s before it kills the rank


class MultiprocExecutor(Executor):
    def __init__(
        self, resolved: ResolvedConfig, eos_token_ids: set[int], execute_timeout_s: float = EXECUTE_TIMEOUT_S
    ) -> None:
        world_size = resolved.tensor_parallel_size
        self.world_size = world_size
        self.execute_timeout_s = execute_timeout_s
        self.last_timings: dict[str, float] = {}
        self._dead: str | None = None
        self.tier_joiner = TierReportJoiner(world_size)  # the ranks' offloading tier reports, as one
        ctx = mp.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        for rank in range(world_size):
            threads, cpus = rank_cpus(rank, world_size)
            spec = RankSpec(rank, world_size, init_method, threads, cpus)
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_main, args=(spec, resolved, set(eos_token_ids), child), name=f"pagellm-tp{rank}", daemon=True
            )
            with _main_not_reimported():
                proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        try:
            self._collect("ready", READY_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise
        logger.info("tensor parallel: %d ranks ready (pids %s)", world_size, self.worker_pids)

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def _fail(self, message: str) -> WorkerDiedError:
        self._dead = message
        self._kill_all()
        logger.error("%s", message)
        return WorkerDiedError(message)

    def _collect(self, expected: str, timeout_s: float) -> list[Any]:
        """Every rank's reply; raises WorkerDiedError on an error, a dead rank or the timeout."""
        replies: list[Any] = [None] * self.world_size
        pending = {conn: rank for rank, conn in enumerate(self.conns)}
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.procs)}
        deadline = time.monotonic() + timeout_s
        while pending:
            left = deadline - time.monotonic()
            ready = wait(list(pending) + list(sentinels), timeout=max(0.0, left))
            if not ready:
                raise self._fail(f"tensor-parallel ranks {sorted(pending.values())} did not answer within {timeout_s:.0f} s")
            # Replies first: a rank that sent its error and then exited should be reported by its error.
            for conn in [r for r in ready if r in pending]:
                rank = pending.pop(conn)
                try:
                    kind, payload = conn.recv()
                except (EOFError, OSError):
                    raise self._fail(f"tensor-parallel rank {rank} closed its pipe (exit code {self.procs[rank].exitcode})") from None
                if kind == "error":
                    raise self._fail(f"tensor-parallel rank {rank} failed:\n{payload}")
                replies[rank] = payload
            for sentinel in [r for r in ready if r in sentinels]:
                rank = sentinels[sentinel]
                proc = self.procs[rank]
                proc.join(0.1)
                raise self._fail(f"tensor-parallel rank {rank} (pid {proc.pid}) died with exit code {proc.exitcode}")
        return replies

    def _broadcast(self, message: tuple[str, Any]) -> list[Any]:
        if self._dead is not None:
            raise WorkerDiedError(self._dead)
        for rank, conn in enumerate(self.conns):
            try:
                conn.send(message)
            except (BrokenPipeError, OSError) as e:
                raise self._fail(f"tensor-parallel rank {rank} is unreachable: {e!r}") from None
        return self._collect("ok", self.execute_timeout_s)

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        return rpc_results(self._broadcast(("call", (method, args))))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        payload = pickle.dumps(scheduler_output, protocol=pickle.HIGHEST_PROTOCOL)
        replies = self._broadcast(("exec", payload))
        output, timings = replies[0]
        self.tier_joiner.apply(output, replies[1:])
        self.last_timings = timings
        return output

    def check_health(self) -> None:
        if self._dead is not None:
            raise WorkerDiedError(self._dead)
        for rank, proc in enumerate(self.procs):
            if not proc.is_alive():
                raise self._fail(f"tensor-parallel rank {rank} (pid {proc.pid}) died with exit code {proc.exitcode}")

    def _kill_all(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(2.0)

    def shutdown(self) -> None:
        for conn in self.conns:
            try:
                conn.send(("shutdown", None))
            except OSError:
                pass
        deadline = time.monotonic() + 5.0
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self._kill_all()
        for conn in self.conns:
            conn.close()
        self.conns = []
        self.procs = []
