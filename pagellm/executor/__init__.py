"""Where the model runs: in this process (``uni``) or as tensor-parallel ranks (``mp``, ``ray``).

The scheduler and the KV cache manager stay in the engine's process; an executor takes each
step's ``SchedulerOutput`` and returns rank 0's ``ModelRunnerOutput``.
"""
