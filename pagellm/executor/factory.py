"""Picks and starts the executor a resolved configuration asks for."""
from __future__ import annotations

from pagellm.executor.base import Executor, UniProcExecutor
from pagellm.executor.worker import Worker
from pagellm.plan.resolved_config import ResolvedConfig


def create_executor(resolved: ResolvedConfig, eos_token_ids: set[int]) -> Executor:
    """The ranks the configuration asks for, each with its model loaded (``uni``: one, in this
    process; ``mp`` and ``ray``: one per tensor-parallel rank)."""
    backend = resolved.args.distributed_executor_backend
    if backend == "uni":
        return UniProcExecutor(Worker(resolved))
    if backend == "mp":
        from pagellm.executor.mp_executor import MultiprocExecutor

        return MultiprocExecutor(resolved, eos_token_ids)
    if backend == "ray":
        from pagellm.executor.ray_executor import RayExecutor

        return RayExecutor(resolved, eos_token_ids)
    raise ValueError(f"no executor for backend {backend!r}")
