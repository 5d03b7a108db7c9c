"""Static batching, the policy before continuous batching (Orca): a batch runs until it drains.

New requests join only an empty batch, so every request in a batch waits for the longest one to
finish before the next batch starts. Paired with the contiguous KV layout it is the traditional
serving design that ``pagellm bench compare`` measures pagellm against.
"""
from __future__ import annotations

from pagellm.core.scheduler import Scheduler


class StaticBatchScheduler(Scheduler):
    def admits_waiting_requests(self) -> bool:
        return not self.running
