"""The executor interface, and the in-process one the single-rank engine uses."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional

from pagellm.core.sched_output import ModelRunnerOutput, SchedulerOutput

BACKENDS = ("uni", "mp", "ray")


class WorkerDiedError(RuntimeError):
    """A rank died, failed or stopped answering; the engine cannot go on."""


class Executor(ABC):
    # Seconds per phase of the last step (prepare, forward, sample; "comm" for collectives).
    last_timings: dict[str, float] = {}

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

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
    """Today's path: the model runner in the engine's own process and thread, nothing in between."""

    def __init__(self, runner, prefaulter: Optional[object] = None) -> None:
        self.runner = runner
        self.prefaulter = prefaulter

    @property
    def last_timings(self) -> dict[str, float]:  # type: ignore[override]
        return self.runner.last_timings

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)

    def prefault_kv_cache(self) -> bool:
        return self.prefaulter.prefault_next() if self.prefaulter is not None else False
