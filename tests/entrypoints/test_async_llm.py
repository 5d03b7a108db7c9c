"""AsyncLLM on a model-free engine: streaming, validation, aborts, idling, overload, crash."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
from fake_engine import FakeEngine

from pagellm.engine.async_llm import AsyncLLM, EngineDeadError, EngineOverloadedError
from pagellm.sampling_params import SamplingParams


class RecordingStats:
    def __init__(self) -> None:
        self.num_steps = 0
        self.outputs = []
        self.itls = []
        self.num_aborted = 0

    def record_step(self, stats, now) -> None:
        self.num_steps += 1

    def record_output(self, output, now, inter_token_latency) -> None:
        self.outputs.append(output)
        if inter_token_latency is not None:
            self.itls.append(inter_token_latency)

    def record_aborted(self, num_requests) -> None:
        self.num_aborted += num_requests


@pytest.fixture
def make_llm():
    llms = []

    def make(**kwargs) -> AsyncLLM:
        stats = kwargs.pop("stat_logger", None)
        llm = AsyncLLM(FakeEngine(**kwargs), stat_logger=stats)
        llms.append(llm)
        return llm

    yield make
    for llm in llms:
        llm.shutdown()


async def collect(llm: AsyncLLM, prompt, params: SamplingParams, request_id: str):
    return [out async for out in llm.generate(prompt, params, request_id)]


def test_generate_streams_deltas_on_the_engine_thread(make_llm):
    stats = RecordingStats()
    llm = make_llm(stat_logger=stats)
    outputs = asyncio.run(collect(llm, "hello", SamplingParams(max_tokens=4), "r1"))
    assert [o.outputs[0].text for o in outputs] == ["t0 ", "t1 ", "t2 ", "t3 "]
    assert [o.finished for o in outputs] == [False, False, False, True]
    assert outputs[-1].outputs[0].finish_reason == "length"
    assert outputs[0].prompt_token_ids == [ord(c) for c in "hello"]
    assert llm.engine.step_threads == {"pagellm-engine"}
    assert len(stats.outputs) == 4 and len(stats.itls) == 3 and all(x >= 0 for x in stats.itls)
    assert llm.num_in_flight == 0


def test_a_factory_builds_the_engine_on_the_thread_that_steps_it():
    # One thread for all of torch's parallel work keeps libgomp's workers spinning (see pagellm/__init__).
    built_on = []

    def factory() -> FakeEngine:
        built_on.append(threading.current_thread().name)
        return FakeEngine()

    llm = AsyncLLM(factory)
    try:
        outputs = asyncio.run(collect(llm, "hi", SamplingParams(max_tokens=2), "r1"))
        assert "".join(o.outputs[0].text for o in outputs) == "t0 t1 "
        assert built_on == ["pagellm-engine"] and llm.engine.step_threads == {"pagellm-engine"}
    finally:
        llm.shutdown()


def test_an_error_building_the_engine_is_raised_by_the_constructor():
    def factory() -> FakeEngine:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        AsyncLLM(factory)


def test_concurrent_requests_all_complete(make_llm):
    llm = make_llm()

    async def main():
        return await asyncio.gather(*(collect(llm, f"p{i}", SamplingParams(max_tokens=3 + i % 3), f"r{i}") for i in range(20)))

    results = asyncio.run(main())
    for i, outputs in enumerate(results):
        assert "".join(o.outputs[0].text for o in outputs) == "".join(f"t{j} " for j in range(3 + i % 3))
        assert outputs[-1].finished


def test_invalid_prompt_raises_value_error_and_engine_keeps_serving(make_llm):
    llm = make_llm()

    async def main():
        with pytest.raises(ValueError, match="not allowed"):
            await llm.add_request("bad1", "bad", SamplingParams(max_tokens=2))
        with pytest.raises(ValueError, match="max_model_len"):
            await llm.add_request("long", "x" * 10, SamplingParams(max_tokens=1000))
        return await collect(llm, "ok", SamplingParams(max_tokens=2), "good")

    outputs = asyncio.run(main())
    assert outputs[-1].finished and not llm.is_dead
    assert not llm.engine.states


def test_lazy_prompt_is_rendered_on_the_engine_thread(make_llm):
    llm = make_llm()
    seen = []

    def prompt():
        import threading

        seen.append(threading.current_thread().name)
        return {"prompt_token_ids": [1, 2, 3]}

    outputs = asyncio.run(collect(llm, prompt, SamplingParams(max_tokens=1), "lazy"))
    assert seen == ["pagellm-engine"]
    assert outputs[0].prompt_token_ids == [1, 2, 3]


def test_consumer_leaving_early_aborts_the_request(make_llm):
    stats = RecordingStats()
    llm = make_llm(step_delay_s=0.005, stat_logger=stats)

    async def main():
        gen = llm.generate("hi", SamplingParams(max_tokens=50), "quitter")
        async for out in gen:
            if out.outputs[0].token_ids == [2]:
                break
        await gen.aclose()
        for _ in range(200):  # the abort is applied at the next step boundary
            if not llm.engine.states:
                break
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert llm.engine.aborted == ["quitter"]
    assert not llm.engine.has_unfinished_requests()
    assert stats.num_aborted == 1


def test_cancelled_task_aborts_its_request(make_llm):
    llm = make_llm(step_delay_s=0.005)

    async def main():
        task = asyncio.ensure_future(collect(llm, "hi", SamplingParams(max_tokens=1000 // 20), "cancelled"))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):
            if llm.engine.aborted:
                break
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert llm.engine.aborted == ["cancelled"]


def test_abort_all_ends_readers_with_finish_reason_abort(make_llm):
    llm = make_llm(step_delay_s=0.01)

    async def main():
        async def read(i):
            return [o async for o in llm.generate("x", SamplingParams(max_tokens=60), f"a{i}")]

        tasks = [asyncio.ensure_future(read(i)) for i in range(3)]
        await asyncio.sleep(0.1)
        llm.abort_all()
        return await asyncio.wait_for(asyncio.gather(*tasks), 5)

    for outputs in asyncio.run(main()):
        assert outputs[-1].finished
        assert outputs[-1].outputs[0].finish_reason == "abort"
    assert not llm.engine.states


def test_engine_thread_sleeps_when_idle(make_llm):
    stats = RecordingStats()
    llm = make_llm(stat_logger=stats)
    asyncio.run(collect(llm, "hi", SamplingParams(max_tokens=3), "r"))
    time.sleep(0.05)
    steps, loops = llm.engine.num_steps, stats.num_steps
    time.sleep(0.3)
    # No busy loop: neither the engine nor the thread's loop ran while nothing was in flight.
    assert (llm.engine.num_steps, stats.num_steps) == (steps, loops)
    outputs = asyncio.run(collect(llm, "again", SamplingParams(max_tokens=2), "r2"))
    assert outputs[-1].finished


def test_idle_engine_thread_prefaults_the_kv_cache_then_sleeps(make_llm):
    llm = make_llm(prefault_slices=5)
    deadline = time.monotonic() + 5
    while llm.engine.prefault_slices_left and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    # Five slices on the engine thread with nothing in flight, then no more calls (it sleeps).
    assert llm.engine.prefault_calls == [("pagellm-engine", 0)] * 5
    assert llm.engine.num_steps == 0


def test_a_request_during_prefaulting_waits_one_slice_at_most(make_llm):
    llm = make_llm(prefault_slices=1000, prefault_delay_s=0.01)
    time.sleep(0.05)
    outputs = asyncio.run(collect(llm, "hi", SamplingParams(max_tokens=3), "r"))
    assert outputs[-1].finished
    calls_when_served = len(llm.engine.prefault_calls)
    assert calls_when_served < 1000  # served in between slices, not after all of them (10 s)
    time.sleep(0.05)
    calls = llm.engine.prefault_calls
    # Never a slice while the request was in the engine; prefaulting went on once it finished.
    assert all(num_in_flight == 0 for _, num_in_flight in calls)
    assert len(calls) > calls_when_served and llm.engine.prefault_slices_left > 0


def test_run_in_engine_returns_results_and_errors(make_llm):
    llm = make_llm()

    async def main():
        ids = await llm.run_in_engine(lambda engine: engine.tokenizer.encode("ab"))
        with pytest.raises(ZeroDivisionError):
            await llm.run_in_engine(lambda engine: 1 / 0)
        return ids

    assert asyncio.run(main()) == [97, 98]
    assert not llm.is_dead


def test_max_waiting_requests_refuses_with_overloaded(make_llm):
    llm = make_llm(max_waiting_requests=2)
    llm.engine.gate.clear()  # hold the engine mid-step so queued adds pile up

    async def main():
        first = asyncio.ensure_future(llm.add_request("r0", "x", SamplingParams(max_tokens=2)))
        await asyncio.sleep(0.05)  # r0 is added; the engine now blocks in step()
        pending = [asyncio.ensure_future(llm.add_request(f"r{i}", "x", SamplingParams(max_tokens=2))) for i in (1, 2)]
        await asyncio.sleep(0)
        with pytest.raises(EngineOverloadedError, match="overloaded"):
            await llm.add_request("r3", "x", SamplingParams(max_tokens=2))
        llm.engine.gate.set()
        streams = [await first] + [await p for p in pending]
        for s in streams:
            async for _ in llm.iterate(s):
                pass

    asyncio.run(main())


def test_engine_crash_fails_in_flight_and_new_requests(make_llm):
    llm = make_llm(step_delay_s=0.01)
    llm.engine.crash_on_step = 5

    async def main():
        with pytest.raises(EngineDeadError, match="injected engine failure"):
            await collect(llm, "x", SamplingParams(max_tokens=50), "doomed")
        assert llm.is_dead
        with pytest.raises(EngineDeadError):
            await llm.add_request("late", "x", SamplingParams(max_tokens=2))
        with pytest.raises(EngineDeadError):
            await llm.run_in_engine(lambda engine: 1)
        llm.abort("doomed")  # harmless on a dead engine

    asyncio.run(main())
    assert isinstance(llm.dead_error, RuntimeError)


def test_duplicate_request_id_is_a_value_error(make_llm):
    llm = make_llm(step_delay_s=0.01)

    async def main():
        stream = await llm.add_request("same", "x", SamplingParams(max_tokens=5))
        with pytest.raises(ValueError, match="already in use"):
            await llm.add_request("same", "x", SamplingParams(max_tokens=5))
        return [o async for o in llm.iterate(stream)]

    assert asyncio.run(main())[-1].finished


def test_shutdown_ends_in_flight_requests(make_llm):
    llm = make_llm(step_delay_s=0.005)

    async def main():
        reader = asyncio.ensure_future(collect(llm, "x", SamplingParams(max_tokens=60), "cut"))
        await asyncio.sleep(0.05)
        await asyncio.to_thread(llm.shutdown)
        with pytest.raises(EngineDeadError, match="shut down"):
            await asyncio.wait_for(reader, 5)
        with pytest.raises(EngineDeadError):
            await llm.add_request("after", "x", SamplingParams(max_tokens=2))

    asyncio.run(main())
