"""The Ray executor: tensor-parallel ranks as actors of a local Ray cluster started in-process."""
from __future__ import annotations

import os
import signal
import time

import pytest

from pagellm import LLM, SamplingParams
from pagellm.executor.base import WorkerDiedError
from pagellm.models.loader import default_model_path

ray = pytest.importorskip("ray", reason="the Ray executor needs ray (pip install 'pagellm[ray]')")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _llm(model: str, **kwargs) -> LLM:
    return LLM(model=model, tokenizer=default_model_path(), num_kv_blocks=64, max_num_seqs=4, max_model_len=128, **kwargs)


PROMPTS = [{"prompt_token_ids": [5 + 7 * i + j for j in range(3 + 9 * i)]} for i in range(4)]
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, logprobs=3, ignore_eos=True)


def test_ray_tp2_matches_tp1_and_a_dead_actor_fails_fast(local_ray, tiny_model):
    ref = _llm(tiny_model)
    expected = [o.outputs[0].token_ids for o in ref.generate(PROMPTS, PARAMS, use_tqdm=False)]
    ref.shutdown()
    llm = _llm(tiny_model, tensor_parallel_size=2, distributed_executor_backend="ray")
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    assert got == expected
    engine = llm.llm_engine
    pids = engine.core.executor.worker_pids
    engine.add_request("long", PROMPTS[0], SamplingParams(max_tokens=100, ignore_eos=True))
    llm._step_thread.submit(engine.step).result()
    os.kill(pids[1], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(WorkerDiedError, match="rank"):
        for _ in range(200):
            llm._step_thread.submit(engine.step).result()
    assert time.monotonic() - t0 < 10
    llm.shutdown()
