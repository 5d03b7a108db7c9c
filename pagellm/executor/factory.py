"""Picks and starts the executor an engine config asks for."""
from __future__ import annotations

import copy

from pagellm.config import EngineConfig
from pagellm.executor.base import Executor


def create_executor(
    config: EngineConfig, model_path: str, num_blocks: int, max_model_len: int, eos_token_ids: set[int]
) -> Executor:
    """The ranks of a tensor-parallel engine (``mp`` or ``ray``), each ready to execute steps."""
    spec_base = dict(
        config=copy.deepcopy(config),
        model_path=model_path,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        eos_token_ids=set(eos_token_ids),
    )
    backend = config.distributed_executor_backend
    if backend == "mp":
        from pagellm.executor.mp_executor import MultiprocExecutor

        return MultiprocExecutor(spec_base, config.tensor_parallel_size)
    if backend == "ray":
        from pagellm.executor.ray_executor import RayExecutor

        return RayExecutor(spec_base, config.tensor_parallel_size)
    raise ValueError(f"no executor for backend {backend!r} here; the uni executor is built by the engine core")
