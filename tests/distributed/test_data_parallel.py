"""Data parallelism: prefix-aware routing over replicas (router alone, then two real replicas)."""
from __future__ import annotations

import asyncio
import random
import re

import pytest

from pagellm.engine.data_parallel import PrefixAwareRouter
from pagellm.sampling_params import SamplingParams

rng = random.Random(0)
PREFIXES = [[rng.randrange(100, 40000) for _ in range(64)] for _ in range(4)]  # 4 blocks of 16 each
REQUESTS = [PREFIXES[i % 4] + [rng.randrange(100, 40000) for _ in range(3 + i % 7)] for i in range(64)]


@pytest.mark.parametrize("num_replicas", [2, 4])
def test_64_requests_over_4_prefixes_stay_with_their_prefix(num_replicas):
    router = PrefixAwareRouter(num_replicas, block_size=16)
    loads = [0] * num_replicas
    where: dict[int, set[int]] = {}
    for i, tokens in enumerate(REQUESTS):
        r = router.choose(tokens, loads=loads)
        loads[r] += 1  # none finishes: load only grows
        where.setdefault(i % 4, set()).add(r)
    assert all(len(replicas) == 1 for replicas in where.values()), where
    # New prefixes go to the least loaded replica: the 4 prefixes spread evenly.
    per_replica = [sum(1 for rs in where.values() if r in rs) for r in range(num_replicas)]
    assert per_replica == [4 // num_replicas] * num_replicas


def test_short_prompts_and_salts_route_by_load():
    router = PrefixAwareRouter(2, block_size=16)
    assert router.block_hashes([1, 2, 3]) == []  # no full block: nothing to match
    assert router.choose([1, 2, 3], loads=[3, 1]) == 1
    a = router.choose(PREFIXES[0], "tenant-a", loads=[0, 0])
    # The same tokens under another salt share no block: it goes by load, not to a's replica.
    b = router.choose(PREFIXES[0], "tenant-b", loads=[1 if r == a else 0 for r in range(2)])
    assert a != b
    assert router.choose(PREFIXES[0] + [7], "tenant-a", loads=[9, 9]) == a


def test_index_is_bounded():
    router = PrefixAwareRouter(1, block_size=1, max_blocks_per_replica=10)
    router.choose(list(range(100)))
    assert len(router.index[0]) == 10


def run_burst(num_replicas: int) -> tuple[list[list[int]], dict[int, int], float]:
    """The 64 requests at once through ``num_replicas`` replicas: outputs, each request's replica,
    and the summed prefix-cache hit share (hit tokens / looked-up tokens over all replicas)."""
    from pagellm.config import EngineConfig
    from pagellm.engine.data_parallel import DPAsyncLLM

    config = EngineConfig(num_kv_blocks=256, max_num_seqs=16, max_model_len=256, device="cpu")
    dp = DPAsyncLLM.from_config(config, num_replicas)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    async def run_all():
        async def one(i: int):
            stream = await dp.add_request(str(i), {"prompt_token_ids": REQUESTS[i]}, params)
            tokens = []
            async for out in stream:
                tokens += out.outputs[0].token_ids
            return tokens

        return await asyncio.gather(*(one(i) for i in range(64)))

    try:
        outputs = asyncio.run(run_all())
        owner = {int(rid): r for rid, r in dp._owner.items()}
        stats = [r.engine.stats().scheduler for r in dp.replicas]
        share = sum(s.prefix_cache_hits for s in stats) / sum(s.prefix_cache_queries for s in stats)
        return outputs, owner, share
    finally:
        dp.shutdown()


@pytest.mark.slow
def test_two_real_replicas_route_prefixes_and_keep_the_hit_share_of_one(no_amx):
    # Equal outputs need a row-invariant kernel whatever each replica batches (conftest.no_amx).
    outputs, owner, share = run_burst(2)
    for p in range(4):
        assert len({owner[i] for i in range(p, 64, 4)}) == 1
    assert set(owner.values()) == {0, 1}
    assert all(len(t) == 4 for t in outputs)
    outputs_one, _, share_one = run_burst(1)
    # Each prefix is computed on one replica only, so the summed hit share stays that of one engine.
    print(f"prefix hit share: DP=1 {share_one:.3f}, DP=2 {share:.3f}")
    assert share_one > 0.5
    assert abs(share - share_one) <= 0.05 * share_one
    assert outputs == outputs_one


@pytest.mark.slow
def test_server_with_two_replicas_serves_and_reports_per_replica_metrics():
    import httpx
    from openai_server_utils import API_KEY, RemoteServer

    server = RemoteServer(
        ["--data-parallel-size", "2", "--num-kv-blocks", "128", "--max-model-len", "256", "--api-key", API_KEY], use_cli=True
    )
    try:
        auth = {"Authorization": f"Bearer {API_KEY}"}
        from concurrent.futures import ThreadPoolExecutor

        def post(i: int) -> httpx.Response:
            body = {"prompt": f"Topic {i}: " + "word " * 40, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
            return httpx.post(f"{server.url}/v1/completions", json=body, headers=auth, timeout=120)

        with ThreadPoolExecutor(4) as pool:  # at once: new prefixes spread by load over both replicas
            for resp in pool.map(post, range(4)):
                assert resp.status_code == 200, resp.text
        text = httpx.get(f"{server.url}/metrics", timeout=30).text
        assert 'pagellm:dp_num_requests_running{replica="0"}' in text
        assert 'pagellm:dp_num_requests_running{replica="1"}' in text
        hits = re.findall(r'^pagellm:dp_prefix_cache_hits\{replica="\d"\} ([0-9.]+)$', text, re.MULTILINE)
        assert len(hits) == 2
        assert "pagellm:generation_tokens_total" in text
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        assert server.terminate() == 0
    finally:
        server.cleanup()
