"""``pagellm bench agent``: its workload generator and its report's arithmetic, without a server."""
import asyncio
import json

import httpx
import numpy as np
import pytest

from pagellm.bench.agent import AgentTrace, agent_report, agent_workload, run_load

TOKENS = np.arange(10, 1010)
SMALL = dict(num_sessions=5, num_turns=4, num_documents=2, document_len=40, document_share=0.6, system_len=6, turn_len=7, output_len=3)


def brute_force(workload):
    """Trie size and each prompt's longest prefix sent before it, by hashing every prefix."""
    seen: set = set()
    ideal = []
    for t in workload.turns:
        key, hits, prefixes = (), 0, []
        for i, tok in enumerate(t.prompt_token_ids):
            key = hash((key, tok))
            prefixes.append(key)
            if key in seen and hits == i:
                hits = i + 1
        ideal.append(hits)
        seen.update(prefixes)
    return len(seen), ideal


def test_workload_is_deterministic_and_histories_are_prefixes():
    a, b = agent_workload(TOKENS, seed=3, **SMALL), agent_workload(TOKENS, seed=3, **SMALL)
    assert [t.prompt_token_ids for t in a.turns] == [t.prompt_token_ids for t in b.turns]
    assert a.session_system == b.session_system
    assert [t.prompt_token_ids for t in agent_workload(TOKENS, seed=4, **SMALL).turns] != [t.prompt_token_ids for t in a.turns]
    # Round-robin send order: every session's turn 0, then every session's turn 1, ...
    assert [(t.turn, t.session) for t in a.turns] == [(t, s) for t in range(4) for s in range(5)]
    by_session = {}
    for t in a.turns:
        by_session.setdefault(t.session, []).append(t.prompt_token_ids)
    for s, prompts in by_session.items():
        system = a.system_lens[a.session_system[s]]
        for t, p in enumerate(prompts):
            assert len(p) == system + t * (7 + 3) + 7  # system, t x (user + reply), this turn's user message
            if t:
                assert p[: len(prompts[t - 1])] == prompts[t - 1]  # the last history is a prefix of the next
    # 3 of 5 sessions open with a document, dealt round-robin over the 2 documents; the others share the short prompt.
    assert sorted(a.session_system) == [0, 0, 1, 2, 2]
    starts = {a.session_system[t.session]: t.prompt_token_ids[: a.system_lens[a.session_system[t.session]]] for t in a.turns}
    assert len({tuple(v) for v in starts.values()}) == 3
    assert all(len(t.prompt_token_ids) and set(t.prompt_token_ids) <= set(TOKENS.tolist()) for t in a.turns)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_working_set_and_ideal_hits_match_a_prefix_trie(seed):
    w = agent_workload(TOKENS, seed=seed, **SMALL)
    trie_size, ideal = brute_force(w)
    assert w.working_set_tokens == trie_size
    assert [t.ideal_cached for t in w.turns] == ideal
    s = w.summary()
    assert s["total_prompt_tokens"] == sum(len(t.prompt_token_ids) for t in w.turns)
    assert s["ideal_hit_share"] == pytest.approx(sum(ideal) / s["total_prompt_tokens"])
    assert s["max_prompt_len"] == 40 + 3 * 10 + 7


def trace(session, turn, prompt_len, ttft, latency, cached=None, source="none", ok=True, ideal=0, server_prompt=None):
    return AgentTrace(session, turn, prompt_len, ideal_cached=ideal, success=ok, cached_tokens=cached, cached_source=source,
                      server_prompt_tokens=server_prompt, output_tokens=4 if ok else None, ttft=ttft, latency=latency)


def test_report_arithmetic_on_canned_traces():
    traces = [
        trace(0, 0, 100, 0.100, 0.5, cached=0, source="usage"),
        trace(1, 0, 100, 0.200, 0.6, cached=96, source="usage", ideal=90),
        trace(0, 1, 200, 0.300, 0.7, cached=112, source="timings", ideal=100, server_prompt=200),
        trace(1, 1, 200, 0.400, 0.8, cached=192, source="usage", ideal=100),
        trace(2, 1, 300, 9.0, 9.0, cached=300, ok=False),  # failed: counted apart, in nothing else
    ]
    summary = {"working_set_tokens": 1000}
    r = agent_report(traces, 10.0, summary, kv_budget_tokens=250)
    assert (r["completed"], r["failed"], r["duration_s"]) == (4, 1, 10.0)
    assert (r["prompt_tokens"], r["cached_tokens"]) == (600, 400)
    assert r["prefix_hit_share"] == pytest.approx(400 / 600)
    assert r["ideal_hit_share"] == pytest.approx(290 / 600)
    assert r["mean_ttft_ms"] == pytest.approx(250.0)
    assert r["median_ttft_ms"] == pytest.approx(250.0)
    assert r["p90_ttft_ms"] == pytest.approx(370.0)  # numpy's linear interpolation: 300 + 0.7 x 100
    assert r["mean_e2el_ms"] == pytest.approx(650.0)
    assert r["cached_tokens_source"] == {"usage": 3, "timings": 1}
    assert r["first_turns"]["prefix_hit_share"] == pytest.approx(96 / 200)
    assert r["later_turns"]["prefix_hit_share"] == pytest.approx(304 / 400)
    assert r["later_turns"]["mean_ttft_ms"] == pytest.approx(350.0)
    assert (r["working_set_tokens"], r["working_set_over_kv_budget"]) == (1000, 4.0)
    # A server that reports no cached tokens: the share is unknown, not zero.
    r = agent_report([trace(0, 0, 100, 0.1, 0.2)], 1.0, summary)
    assert r["cached_tokens"] is None and r["prefix_hit_share"] is None and r["working_set_over_kv_budget"] is None


class FakeServer:
    """Streams output_len chunks; reports cached tokens as pagellm (usage chunk) or llama.cpp (final chunk + timings)."""

    def __init__(self, style):
        self.style, self.prompts, self.in_flight, self.peak = style, [], 0, 0

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        payload = json.loads(request.content)
        assert payload["stream"] and payload["ignore_eos"] and payload["stream_options"] == {"include_usage": True}
        self.prompts.append(payload["prompt"])
        cached = len(payload["prompt"]) // 2
        usage = {"prompt_tokens": len(payload["prompt"]), "completion_tokens": payload["max_tokens"]}
        events = [{"choices": [{"text": "x"}]} for _ in range(payload["max_tokens"])]
        if self.style == "pagellm":
            events.append({"choices": [], "usage": dict(usage, prompt_tokens_details={"cached_tokens": cached})})
        else:
            events.append({"choices": [{"text": ""}], "timings": {"cache_n": cached}})
        body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, content=body.encode(), headers={"content-type": "text/event-stream"})


@pytest.mark.parametrize("style,source", [("pagellm", "usage"), ("llamacpp", "timings")])
def test_load_sends_every_turn_in_order_and_reads_cached_tokens(style, source):
    w = agent_workload(TOKENS, seed=0, **SMALL)
    server = FakeServer(style)
    traces, duration, model = asyncio.run(
        run_load("http://fake", w, [t.prompt_token_ids for t in w.turns], max_concurrency=2, probe_prompt=[1, 2],
                 transport=httpx.MockTransport(server.handle))
    )
    assert model == "m" and len(traces) == len(w.turns) and all(t.success for t in traces)
    assert server.prompts[0] == [1, 2] and server.prompts[1:] == [t.prompt_token_ids for t in w.turns]
    assert all(t.cached_source == source and t.cached_tokens == t.prompt_len // 2 for t in traces)


def test_registered_as_bench_agent():
    from pagellm.cli import build_parser

    args = build_parser().parse_args(["bench", "agent", "--num-sessions", "4", "--save-result", "out.json", "--dry-run"])
    assert (args.num_sessions, args.num_turns, args.save_result, args.dry_run, args.prompt_format) == (4, 8, "out.json", True, "ids")
    assert callable(args.func)


def test_the_tiers_counters_are_read_from_metrics_and_reported(monkeypatch):
    import httpx

    from pagellm.bench import agent

    texts = iter([
        'pagellm:kv_tier_hit_tokens_total{model_name="m"} 100.0\npagellm:kv_tier_loads_total{model_name="m"} 1.0\n',
        'pagellm:kv_tier_hit_tokens_total{model_name="m"} 612.0\npagellm:kv_tier_loads_total{model_name="m"} 5.0\n'
        'pagellm:kv_tier_load_seconds_total{model_name="m"} 0.4\npagellm:kv_cache_usage_perc{model_name="m"} 0.5\n',
    ])
    monkeypatch.setattr(httpx, "get", lambda url, timeout: httpx.Response(200, text=next(texts)))
    before, after = agent.scrape_tier("http://x"), agent.scrape_tier("http://x")
    delta = agent.tier_delta(before, after)
    assert delta == {"kv_tier_hit_tokens_total": 512.0, "kv_tier_loads_total": 4.0, "kv_tier_load_seconds_total": 0.4}
    monkeypatch.setattr(httpx, "get", lambda url, timeout: httpx.Response(200, text="llamacpp:prompt_tokens_total 5\n"))
    assert agent.scrape_tier("http://x") is None and agent.tier_delta(None, None) is None
