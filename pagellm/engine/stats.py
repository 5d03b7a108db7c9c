"""What the engine reports about itself: one read-only snapshot for the server, metrics and benchmarks."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from pagellm.core.scheduler import SchedulerStats


@dataclass(frozen=True)
class StepStats:
    """One engine step and where its time went (seconds)."""

    num_scheduled_tokens: int
    num_reqs: int
    num_prefill_tokens: int
    duration_s: float
    schedule_s: float = 0.0
    prepare_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
    update_s: float = 0.0
    comm_s: float = 0.0  # tensor parallelism: rank 0's time in collectives (all-reduce, all-gather, broadcast)


@dataclass
class StepTotals:
    """Running sums over steps that carried prompt tokens and over decode-only steps."""

    num_steps: int = 0
    prefill_steps_s: float = 0.0
    prefill_tokens: int = 0
    decode_steps_s: float = 0.0
    decode_tokens: int = 0
    steps_s: float = 0.0
    comm_s: float = 0.0

    def add(self, step: StepStats) -> None:
        self.num_steps += 1
        self.steps_s += step.duration_s
        self.comm_s += step.comm_s
        if step.num_prefill_tokens:
            self.prefill_steps_s += step.duration_s
            self.prefill_tokens += step.num_prefill_tokens
        else:
            self.decode_steps_s += step.duration_s
            self.decode_tokens += step.num_scheduled_tokens


@dataclass(frozen=True)
class EngineStats:
    scheduler: SchedulerStats
    steps: StepTotals = field(default_factory=StepTotals)
    last_step: Optional[StepStats] = None

    @property
    def prefill_tokens_per_s(self) -> Optional[float]:
        return self.steps.prefill_tokens / self.steps.prefill_steps_s if self.steps.prefill_steps_s else None

    @property
    def decode_tokens_per_s(self) -> Optional[float]:
        return self.steps.decode_tokens / self.steps.decode_steps_s if self.steps.decode_steps_s else None
