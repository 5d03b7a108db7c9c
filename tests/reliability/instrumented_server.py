"""``pagellm``'s real API server with test-only instruments, run as ``python instrumented_server.py ARGS``.

Everything the real server does is unchanged; this wrapper only adds, before ``main`` runs:

* ``GET /debug/engine``: runs the block pool's and the KV manager's integrity checks *on the engine
  thread* (between steps, where the books must balance) and reports what the engine still holds:
  blocks in use, cached free blocks, requests in the scheduler, the output processor and AsyncLLM.
* With ``PAGELLM_TEST_FAULTS=1`` in the environment, fault injection keyed on the request's ``seed``
  (a field every route accepts and passes through): ``FAIL_SEED`` makes that request's sampling
  raise, ``CRASH_SEED`` makes the engine step itself raise. Off otherwise, so that fuzzers and the
  soak cannot trip them by chance.

Nothing here is importable by the package: the faults exist only in processes started from tests.
"""
from __future__ import annotations

import os
import sys

FAIL_SEED = 424242  # sampling raises for this request only
CRASH_SEED = 131313  # the next engine step raises: the engine loop dies


def _install_faults() -> None:
    from pagellm.engine.engine_core import EngineCore
    from pagellm.worker.model_runner import ModelRunner

    original_sample_rows = ModelRunner._sample_rows

    def sample_rows(self, logits, rows, req_ids, result):
        for row in rows.tolist():
            params = self.input_batch.params[row]
            if params is not None and params.seed == FAIL_SEED:
                raise RuntimeError("injected sampling failure")
        return original_sample_rows(self, logits, rows, req_ids, result)

    ModelRunner._sample_rows = sample_rows

    original_step = EngineCore.step

    def step(self):
        if any(r.sampling_params.seed == CRASH_SEED for r in self.scheduler.requests.values()):
            raise RuntimeError("injected engine failure")
        return original_step(self)

    EngineCore.step = step


def _install_debug_route() -> None:
    from pagellm.entrypoints.openai import api_server

    original_build_app = api_server.build_app

    def build_app(async_llm, *args, **kwargs):
        app = original_build_app(async_llm, *args, **kwargs)

        def snapshot(engine) -> dict:
            # Runs on the engine thread, between steps.
            kv = engine.core.kv_cache_manager
            kv.check_integrity()
            pool = kv.block_pool
            return {
                "num_blocks": pool.num_blocks,
                "num_free_blocks": pool.num_free_blocks,
                "num_used_blocks": pool.num_used_blocks,
                "num_cached_free_blocks": pool.num_cached_free_blocks,
                "num_referenced_blocks": sum(1 for b in pool.blocks if b.ref_cnt > 0),
                "num_block_owners": len(kv.req_to_blocks),
                "num_scheduler_requests": len(engine.core.scheduler.requests),
                "num_waiting": len(engine.core.scheduler.waiting),
                "num_running": len(engine.core.scheduler.running),
                "num_output_states": len(engine.output_processor.request_states),
                "num_streams": len(async_llm._streams),
                "total_num_preemptions": engine.core.scheduler.num_preemptions,
            }

        @app.get("/debug/engine")
        async def debug_engine() -> dict:
            return await async_llm.run_in_engine(snapshot)

        return app

    api_server.build_app = build_app


def main() -> int:
    if os.environ.get("PAGELLM_TEST_FAULTS") == "1":
        _install_faults()
    _install_debug_route()
    from pagellm.entrypoints.openai import api_server

    return api_server.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
