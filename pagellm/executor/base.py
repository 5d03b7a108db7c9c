"""The executor interface, and the in-process one a single-rank engine uses.

Every executor runs the same :class:`~pagellm.executor.worker.Worker` class, one per rank; the
engine core talks to them only through these methods.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Optional

from pagellm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagellm.executor.kv_tier import common_keys
from pagellm.executor.worker import Worker
from pagellm.lora.request import LoRARequest
from pagellm.plan.kv_cache_plan import KVCachePlan
from pagellm.structured_output import StructuredOutputManager

BACKENDS = ("uni", "mp", "ray")


class WorkerDiedError(RuntimeError):
    """A rank died, failed or stopped answering; the engine cannot go on."""


class Executor(ABC):
    # Seconds per phase of the last step (prepare, forward, sample; "comm" for collectives).
    last_timings: dict[str, float] = {}

    @abstractmethod
    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Calls ``Worker.<method>(*args)`` on every rank; their results in rank order. A
        ValueError on a rank (a bad adapter, say) is raised here and leaves the ranks running."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def available_kv_cache_bytes(self) -> int:
        """The KV cache budget every rank can give (an accelerator's free memory after loading)."""
        return min(self.collective_rpc("available_kv_cache_bytes"))

    def initialize_kv_cache(self, kv_cache: KVCachePlan, structured_output: Optional[StructuredOutputManager] = None) -> None:
        """Every rank allocates ``kv_cache.num_blocks`` blocks and builds its runner; rank 0 of a
        remote executor builds its own grammar masks, so ``structured_output`` stays in this process."""
        self.collective_rpc("initialize_kv_cache", kv_cache)

    def release_kv_cache(self) -> None:
        self.collective_rpc("release_kv_cache")

    def kv_tier_keys(self) -> list[bytes]:
        """What the offloading tier holds at start: the keys every rank's store holds."""
        return common_keys(self.collective_rpc("kv_tier_keys"))

    def add_lora(self, lora: LoRARequest) -> None:
        self.collective_rpc("add_lora", lora)

    def remove_lora(self, lora_int_id: int) -> bool:
        return all(self.collective_rpc("remove_lora", lora_int_id))

    def check_health(self) -> None:
        """Raises ``WorkerDiedError`` if a rank is gone."""
        return None

    def shutdown(self) -> None:
        """Stops the ranks; idempotent."""
        return None

    def prefault_kv_cache(self) -> bool:
        """Faults in one more slice of the KV cache (idle time); whether any remain."""
        return False


class UniProcExecutor(Executor):
    """One worker in the engine's own process and thread, nothing in between."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    @property
    def last_timings(self) -> dict[str, float]:  # type: ignore[override]
        return self.worker.last_timings

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        return [getattr(self.worker, method)(*args)]

    def initialize_kv_cache(self, kv_cache: KVCachePlan, structured_output: Optional[StructuredOutputManager] = None) -> None:
        self.worker.initialize_kv_cache(kv_cache, structured_output)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def prefault_kv_cache(self) -> bool:
        return self.worker.prefault_kv_cache()
