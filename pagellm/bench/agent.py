"""``pagellm bench agent``: a multi-turn agent load whose prefixes outgrow the KV budget.

    pagellm serve --num-kv-blocks 512 &            # or llama.cpp's llama-server, or vllm serve
    pagellm bench agent --base-url http://127.0.0.1:8000 --num-sessions 32 --num-turns 8 \\
        --num-documents 4 --document-len 2000 --turn-len 128 --output-len 32 --max-concurrency 2 \\
        --kv-budget-tokens 8192 --save-result agent.json

The workload (seeded, deterministic, the same token ids for every server):

* ``--num-documents`` long shared documents of ``--document-len`` tokens and one short system
  prompt of ``--system-len`` tokens. A seeded ``--document-share`` of the sessions open with a
  document (the documents dealt round-robin among them), the others with the short system prompt.
* Each of ``--num-sessions`` sessions runs ``--num-turns`` turns. Turn ``t``'s prompt is the whole
  history: the system part, then for each earlier turn its user message (``--turn-len`` tokens)
  and its reply (``--output-len`` tokens), then turn ``t``'s user message. The server generates
  ``--output-len`` tokens (``ignore_eos``), but the history keeps a fixed synthetic reply of that
  length, not the server's: the prompts are then identical token for token on every server and in
  every run (a model's sampled reply, or its text re-tokenized, would differ between servers and
  make their hit shares incomparable). The cost: a server cannot reuse the KV it wrote while
  decoding, only the prompt before it, so every turn recomputes at least one reply.
* Requests go round-robin over the sessions (turn 0 of every session, then turn 1 of every
  session, ...), ``--max-concurrency`` in flight, a session's turn never before its previous turn
  has finished. With many sessions, a session's prefix has left a small KV budget by the time its
  next turn comes: what a second tier under the prefix cache is for.

Prompts go as token ids to the streaming ``/v1/completions`` endpoint (``--prompt-format text``
decodes them, as ``bench serve`` does). Per request it times the first streamed choice (TTFT) and the
last (E2E latency), and reads the prompt tokens the server reused: ``usage.prompt_tokens_details
.cached_tokens`` (pagellm and vLLM in the ``stream_options.include_usage`` chunk; llama.cpp's server
in its final chunk), else llama.cpp's ``timings.cache_n``. The report: prompt tokens, the prefix-hit
share (cached / prompt tokens) against the ideal share an unbounded cache would reach (each prompt's
longest prefix sent before, in send order), TTFT mean / p50 / p90, mean E2E latency, wall time, and
the working set (the distinct prompt tokens the load touches, i.e. the size of its prefix trie) next
to ``--kv-budget-tokens``. ``--dry-run`` prints the workload's sizes without a server.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import asdict, dataclass
from typing import Any, Optional, Sequence

import httpx
import numpy as np

from pagellm.bench.serve import Prompt, StreamError, completion_messages, completion_payload, get_first_model


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default=None, help="server root, e.g. http://127.0.0.1:8000")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--endpoint", default="/v1/completions")
    parser.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer for the prompts (default: the packaged model's)")
    parser.add_argument("--prompt-format", default="ids", choices=["ids", "text"], help="send token ids or decoded text")
    g = parser.add_argument_group("workload")
    g.add_argument("--num-sessions", type=int, default=32)
    g.add_argument("--num-turns", type=int, default=8)
    g.add_argument("--num-documents", type=int, default=4, help="long shared documents a session may open with")
    g.add_argument("--document-len", type=int, default=2000)
    g.add_argument("--document-share", type=float, default=0.5, help="share of the sessions that open with a document")
    g.add_argument("--system-len", type=int, default=64, help="the short system prompt of the other sessions")
    g.add_argument("--turn-len", type=int, default=128, help="tokens of each user message")
    g.add_argument("--output-len", type=int, default=32, help="tokens generated per turn, and of each reply kept in the history")
    g.add_argument("--max-concurrency", type=int, default=2)
    g.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=None, help="sent only when given")
    parser.add_argument("--kv-budget-tokens", type=int, default=None, help="the server's KV budget, to print working set / budget")
    parser.add_argument("--label", default=None, help="a name for this run in the result (e.g. the server and its flags)")
    parser.add_argument("--save-result", default=None, metavar="FILE", help="write the result as JSON")
    parser.add_argument("--dry-run", action="store_true", help="print the workload's sizes and exit; needs no server")
    parser.add_argument("--disable-tqdm", action="store_true")
    parser.add_argument("--request-timeout", type=float, default=6 * 3600, help="seconds per request")


# ---- the workload -------------------------------------------------------------------------


@dataclass
class AgentTurn:
    session: int
    turn: int
    prompt_token_ids: list[int]
    output_len: int
    ideal_cached: int = 0  # the longest prefix of this prompt that an earlier-sent prompt had

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class AgentWorkload:
    turns: list[AgentTurn]  # in send order
    session_system: list[int]  # per session: its system part, 0..D-1 a document, D the short prompt
    system_lens: list[int]
    params: dict[str, Any]

    @property
    def total_prompt_tokens(self) -> int:
        return sum(t.prompt_len for t in self.turns)

    @property
    def ideal_cached_tokens(self) -> int:
        return sum(t.ideal_cached for t in self.turns)

    @property
    def max_prompt_len(self) -> int:
        return max(t.prompt_len for t in self.turns)

    @property
    def working_set_tokens(self) -> int:
        """Distinct prompt tokens (nodes of the prompts' prefix trie): each system part used once,
        plus each session's last prompt past its system part (its earlier prompts are prefixes of it)."""
        used = sorted(set(self.session_system))
        last = {t.session: t.prompt_len for t in self.turns}  # send order: the last turn comes last
        return sum(self.system_lens[i] for i in used) + sum(n - self.system_lens[self.session_system[s]] for s, n in last.items())

    def summary(self) -> dict[str, Any]:
        total = self.total_prompt_tokens
        return dict(
            self.params,
            num_requests=len(self.turns),
            total_prompt_tokens=total,
            max_prompt_len=self.max_prompt_len,
            working_set_tokens=self.working_set_tokens,
            ideal_cached_tokens=self.ideal_cached_tokens,
            ideal_hit_share=self.ideal_cached_tokens / total if total else 0.0,
            sessions_with_document=sum(1 for i in self.session_system if i < len(self.system_lens) - 1),
        )


def _positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be positive, got {value}")


def agent_workload(
    token_ids: np.ndarray,
    num_sessions: int = 32,
    num_turns: int = 8,
    num_documents: int = 4,
    document_len: int = 2000,
    document_share: float = 0.5,
    system_len: int = 64,
    turn_len: int = 128,
    output_len: int = 32,
    seed: int = 0,
) -> AgentWorkload:
    """The load, in send order (round-robin over sessions, turn by turn)."""
    _positive(num_sessions=num_sessions, num_turns=num_turns, system_len=system_len, turn_len=turn_len, output_len=output_len)
    if num_documents < 0 or (num_documents and document_len < 1):
        raise ValueError("need num_documents >= 0 and a positive document_len")
    if not 0.0 <= document_share <= 1.0:
        raise ValueError(f"document_share must be in [0, 1], got {document_share}")
    rng = np.random.default_rng(seed)

    def draw(n: int) -> list[int]:
        return token_ids[rng.integers(0, token_ids.size, size=n)].tolist()

    systems = [draw(document_len) for _ in range(num_documents)] + [draw(system_len)]
    num_with_document = round(num_sessions * document_share) if num_documents else 0
    session_system = [num_documents] * num_sessions
    for rank, s in enumerate(rng.permutation(num_sessions)[:num_with_document].tolist()):
        session_system[s] = rank % num_documents
    # Each session's user messages and (synthetic) replies, drawn session by session.
    messages = [[(draw(turn_len), draw(output_len)) for _ in range(num_turns)] for _ in range(num_sessions)]
    prompts: list[list[list[int]]] = []
    for s in range(num_sessions):
        history = list(systems[session_system[s]])
        session_prompts = []
        for user, reply in messages[s]:
            session_prompts.append(history + user)
            history = history + user + reply
        prompts.append(session_prompts)
    turns = []
    seen_system: set[int] = set()
    for t in range(num_turns):
        for s in range(num_sessions):
            if t > 0:
                ideal = len(prompts[s][t - 1])  # the reply after it is synthetic: no server has it
            else:
                ideal = len(systems[session_system[s]]) if session_system[s] in seen_system else 0
                seen_system.add(session_system[s])
            turns.append(AgentTurn(s, t, prompts[s][t], output_len, ideal))
    params = dict(
        num_sessions=num_sessions, num_turns=num_turns, num_documents=num_documents, document_len=document_len,
        document_share=document_share, system_len=system_len, turn_len=turn_len, output_len=output_len, seed=seed,
    )
    return AgentWorkload(turns, session_system, [len(x) for x in systems], params)


# ---- one request --------------------------------------------------------------------------


@dataclass
class AgentTrace:
    session: int
    turn: int
    prompt_len: int  # as sent (token ids); the server's count, when it reports one, is server_prompt_tokens
    ideal_cached: int = 0
    success: bool = False
    cached_tokens: Optional[int] = None
    cached_source: str = "none"  # "usage" (prompt_tokens_details.cached_tokens), "timings" (llama.cpp's cache_n) or "none"
    server_prompt_tokens: Optional[int] = None
    output_tokens: Optional[int] = None
    ttft: float = 0.0
    latency: float = 0.0
    start_time: float = 0.0
    error: str = ""


def _read_cached(message: dict[str, Any], trace: AgentTrace) -> None:
    usage = message.get("usage") or {}
    if usage:
        if usage.get("prompt_tokens") is not None:
            trace.server_prompt_tokens = int(usage["prompt_tokens"])
        if usage.get("completion_tokens") is not None:
            trace.output_tokens = int(usage["completion_tokens"])
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            trace.cached_tokens, trace.cached_source = int(details["cached_tokens"]), "usage"
            return
    timings = message.get("timings") or {}
    if timings.get("cache_n") is not None and trace.cached_source != "usage":
        trace.cached_tokens, trace.cached_source = int(timings["cache_n"]), "timings"


async def request_turn(client: httpx.AsyncClient, url: str, payload: dict[str, Any], trace: AgentTrace) -> AgentTrace:
    """Streams one completion; TTFT at the first chunk with a choice, E2E at the last one.

    Sent once more, timed afresh, when the server closed the connection before answering at all: a
    kept-alive connection that the server (llama.cpp's, after 5 idle seconds) closed as it was reused.
    """
    trace = await _request_turn_once(client, url, payload, trace)
    if trace.error.startswith("RemoteProtocolError: Server disconnected without sending a response"):
        trace.error = ""
        trace = await _request_turn_once(client, url, payload, trace)
    return trace


async def _request_turn_once(client: httpx.AsyncClient, url: str, payload: dict[str, Any], trace: AgentTrace) -> AgentTrace:
    st = time.perf_counter()
    trace.start_time = st
    last = st
    chunks = 0
    try:
        async for message in completion_messages(client, url, payload):
            if message.get("choices"):
                now = time.perf_counter()
                if chunks == 0:
                    trace.ttft = now - st
                last = now
                chunks += 1
            _read_cached(message, trace)
        trace.latency = last - st
        if chunks:
            trace.success = True
        else:
            trace.error = "the stream carried no completion chunk"
    except StreamError as e:
        trace.error = str(e)
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        trace.error = f"{type(e).__name__}: {e}"
    return trace


async def run_load(
    base_url: str,
    workload: AgentWorkload,
    prompts: Sequence[Prompt],
    model: Optional[str] = None,
    endpoint: str = "/v1/completions",
    max_concurrency: int = 2,
    temperature: Optional[float] = None,
    probe_prompt: Optional[Prompt] = None,
    disable_tqdm: bool = True,
    request_timeout: float = 6 * 3600,
    transport: Optional[httpx.AsyncBaseTransport] = None,
) -> tuple[list[AgentTrace], float, str]:
    """Sends the turns in order, ``max_concurrency`` workers; a turn waits for its session's previous one."""
    from tqdm.auto import tqdm

    if max_concurrency < 1:
        raise ValueError(f"max concurrency must be positive, got {max_concurrency}")
    turns = workload.turns
    base_url = base_url.rstrip("/")
    url = base_url + endpoint
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(request_timeout), limits=limits, transport=transport) as client:
        model = model or await get_first_model(client, base_url)
        if probe_prompt is not None:  # fails a misconfigured run fast; shares no prefix with the load
            probe = await request_turn(client, url, completion_payload(model, probe_prompt, 1, temperature), AgentTrace(-1, -1, 0))
            if not probe.success:
                raise ValueError(f"the test request to {url} failed: {probe.error}")
        done = {(t.session, t.turn): asyncio.Event() for t in turns}
        traces: list[Optional[AgentTrace]] = [None] * len(turns)
        next_index = 0
        bar = tqdm(total=len(turns), disable=disable_tqdm, dynamic_ncols=True)

        async def worker() -> None:
            nonlocal next_index
            while next_index < len(turns):
                i = next_index
                next_index += 1
                turn = turns[i]
                try:
                    if turn.turn > 0:
                        await done[(turn.session, turn.turn - 1)].wait()
                    payload = completion_payload(model, prompts[i], turn.output_len, temperature)
                    trace = AgentTrace(turn.session, turn.turn, turn.prompt_len, turn.ideal_cached)
                    traces[i] = await request_turn(client, url, payload, trace)
                finally:
                    done[(turn.session, turn.turn)].set()
                    bar.update(1)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(max_concurrency)))
        duration = time.perf_counter() - start
        bar.close()
    return [t for t in traces if t is not None], duration, model


# ---- the report ---------------------------------------------------------------------------


def _ms(values: Sequence[float], q: Optional[float] = None) -> float:
    if not len(values):
        return 0.0
    arr = np.asarray(values, dtype=np.float64) * 1000
    return float(np.mean(arr) if q is None else np.percentile(arr, q))


def _part(traces: Sequence[AgentTrace]) -> dict[str, Any]:
    ok = [t for t in traces if t.success]
    prompt = sum(t.server_prompt_tokens if t.server_prompt_tokens is not None else t.prompt_len for t in ok)
    reported = [t for t in ok if t.cached_tokens is not None]
    cached = sum(t.cached_tokens for t in reported)
    ttfts = [t.ttft for t in ok]
    return {
        "completed": len(ok),
        "prompt_tokens": prompt,
        "cached_tokens": cached if reported else None,
        "prefix_hit_share": cached / prompt if reported and prompt else None,
        "ideal_hit_share": sum(t.ideal_cached for t in ok) / prompt if prompt else 0.0,
        "mean_ttft_ms": _ms(ttfts),
        "median_ttft_ms": _ms(ttfts, 50),
        "p90_ttft_ms": _ms(ttfts, 90),
        "mean_e2el_ms": _ms([t.latency for t in ok]),
    }


def agent_report(
    traces: Sequence[AgentTrace], duration_s: float, workload_summary: dict[str, Any], kv_budget_tokens: Optional[int] = None
) -> dict[str, Any]:
    """Totals over the successful requests, and the same for first turns and later turns apart."""
    result = _part(traces)
    sources: dict[str, int] = {}
    for t in traces:
        if t.success:
            sources[t.cached_source] = sources.get(t.cached_source, 0) + 1
    result.update(
        failed=sum(1 for t in traces if not t.success),
        duration_s=duration_s,
        cached_tokens_source=sources,
        output_tokens=sum(t.output_tokens or 0 for t in traces if t.success),
        first_turns=_part([t for t in traces if t.turn == 0]),
        later_turns=_part([t for t in traces if t.turn > 0]),
        workload=workload_summary,
        working_set_tokens=workload_summary["working_set_tokens"],
        kv_budget_tokens=kv_budget_tokens,
        working_set_over_kv_budget=workload_summary["working_set_tokens"] / kv_budget_tokens if kv_budget_tokens else None,
    )
    return result


def _share(value: Optional[float]) -> str:
    return "n/a (not reported)" if value is None else f"{100 * value:.1f}%"


def format_workload(summary: dict[str, Any], kv_budget_tokens: Optional[int] = None) -> str:
    lines = [
        f"{'Sessions x turns (requests):':<40}{summary['num_sessions']} x {summary['num_turns']} ({summary['num_requests']})",
        f"{'Sessions opening with a document:':<40}{summary['sessions_with_document']} "
        f"(of {summary['num_documents']} x {summary['document_len']} tokens)",
        f"{'Total prompt tokens:':<40}{summary['total_prompt_tokens']}",
        f"{'Longest prompt (+ output):':<40}{summary['max_prompt_len']} (+ {summary['output_len']})",
        f"{'Working set (distinct prompt tokens):':<40}{summary['working_set_tokens']}",
        f"{'Ideal hit share (unbounded cache):':<40}{_share(summary['ideal_hit_share'])}",
    ]
    if kv_budget_tokens:
        lines.append(f"{'KV budget (tokens):':<40}{kv_budget_tokens} (working set {summary['working_set_tokens'] / kv_budget_tokens:.2f}x)")
    return "\n".join(lines)


TIER_SERIES = (
    "kv_tier_hit_tokens_total",
    "kv_tier_loads_total",
    "kv_tier_blocks_loaded_total",
    "kv_tier_blocks_failed_total",
    "kv_tier_saves_total",
    "kv_tier_bytes_read_total",
    "kv_tier_bytes_written_total",
    "kv_tier_load_seconds_total",
    "kv_tier_evictions_total",
    "kv_tier_corrupt_total",
    "kv_tier_write_errors_total",
    "kv_tier_dropped_saves_total",
)


def scrape_tier(base_url: str) -> Optional[dict[str, float]]:
    """pagellm's offloading-tier counters from /metrics; None where the server has none (no tier,
    or another server)."""
    try:
        text = httpx.get(f"{base_url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    values: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name.startswith("pagellm:") and name[len("pagellm:") :] in TIER_SERIES:
            values[name[len("pagellm:") :]] = values.get(name[len("pagellm:") :], 0.0) + float(line.rsplit(" ", 1)[1])
    return values or None


def tier_delta(before: Optional[dict[str, float]], after: Optional[dict[str, float]]) -> Optional[dict[str, float]]:
    if after is None:
        return None
    return {k: v - (before or {}).get(k, 0.0) for k, v in after.items()}


def format_report(result: dict[str, Any]) -> str:
    sources = ", ".join(f"{k} {v}" for k, v in sorted(result["cached_tokens_source"].items())) or "-"
    lines = [
        "{s:{c}^60}".format(s=f" Agent benchmark{': ' + result['label'] if result.get('label') else ''} ", c="="),
        format_workload(result["workload"], result.get("kv_budget_tokens")),
        "-" * 60,
        f"{'Completed / failed requests:':<40}{result['completed']} / {result['failed']}",
        f"{'Wall time (s):':<40}{result['duration_s']:.2f}",
        f"{'Prompt tokens:':<40}{result['prompt_tokens']}",
        f"{'Cached prompt tokens:':<40}{result['cached_tokens'] if result['cached_tokens'] is not None else 'n/a'}"
        f" (from: {sources})",
        f"{'Prefix-hit share (ideal):':<40}{_share(result['prefix_hit_share'])} ({_share(result['ideal_hit_share'])})",
        f"{'  first turns / later turns:':<40}{_share(result['first_turns']['prefix_hit_share'])} / "
        f"{_share(result['later_turns']['prefix_hit_share'])}",
        f"{'Mean / p50 / p90 TTFT (ms):':<40}{result['mean_ttft_ms']:.1f} / {result['median_ttft_ms']:.1f} / {result['p90_ttft_ms']:.1f}",
        f"{'  mean TTFT first / later turns (ms):':<40}{result['first_turns']['mean_ttft_ms']:.1f} / "
        f"{result['later_turns']['mean_ttft_ms']:.1f}",
        f"{'Mean E2E latency (ms):':<40}{result['mean_e2el_ms']:.1f}",
    ]
    tier = result.get("kv_tier")
    if tier:
        loads = tier.get("kv_tier_loads_total", 0.0)
        lines += [
            f"{'Tier: prompt tokens served:':<40}{tier.get('kv_tier_hit_tokens_total', 0):.0f}"
            f" ({tier.get('kv_tier_blocks_loaded_total', 0):.0f} blocks, {tier.get('kv_tier_blocks_failed_total', 0):.0f} failed)",
            f"{'Tier: MB read / written:':<40}{tier.get('kv_tier_bytes_read_total', 0) / 1e6:.1f} / "
            f"{tier.get('kv_tier_bytes_written_total', 0) / 1e6:.1f}",
            f"{'Tier: mean load (ms):':<40}{1e3 * tier.get('kv_tier_load_seconds_total', 0) / loads if loads else 0:.1f}"
            f" over {loads:.0f} loads",
            f"{'Tier: evicted / damaged / dropped:':<40}{tier.get('kv_tier_evictions_total', 0):.0f} / "
            f"{tier.get('kv_tier_corrupt_total', 0):.0f} / {tier.get('kv_tier_dropped_saves_total', 0):.0f}",
        ]
    lines.append("=" * 60)
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    from pagellm.bench.datasets import tokenizer_token_ids
    from pagellm.models.loader import default_model_path
    from pagellm.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer or default_model_path())
    token_ids = tokenizer_token_ids(tokenizer)
    workload = agent_workload(
        token_ids,
        num_sessions=args.num_sessions,
        num_turns=args.num_turns,
        num_documents=args.num_documents,
        document_len=args.document_len,
        document_share=args.document_share,
        system_len=args.system_len,
        turn_len=args.turn_len,
        output_len=args.output_len,
        seed=args.seed,
    )
    summary = workload.summary()
    if args.dry_run:
        print(format_workload(summary, args.kv_budget_tokens))
        if args.save_result:
            with open(args.save_result, "w") as f:
                json.dump({"workload": summary, "kv_budget_tokens": args.kv_budget_tokens}, f, indent=2)
        return 0
    if args.prompt_format == "text":
        prompts: list[Prompt] = [tokenizer.decode(t.prompt_token_ids) for t in workload.turns]
    else:
        prompts = [t.prompt_token_ids for t in workload.turns]
    probe_ids = token_ids[np.random.default_rng(args.seed + 7919).integers(0, token_ids.size, size=8)].tolist()
    probe: Prompt = tokenizer.decode(probe_ids) if args.prompt_format == "text" else probe_ids
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    tier_before = scrape_tier(base_url)
    traces, duration, model = asyncio.run(
        run_load(
            base_url, workload, prompts, model=args.model, endpoint=args.endpoint, max_concurrency=args.max_concurrency,
            temperature=args.temperature, probe_prompt=probe, disable_tqdm=args.disable_tqdm, request_timeout=args.request_timeout,
        )
    )
    for i, t in enumerate([t for t in traces if not t.success][:10]):
        print(f"Error {i} (session {t.session}, turn {t.turn}): {t.error}")
    result = agent_report(traces, duration, summary, args.kv_budget_tokens)
    result["kv_tier"] = tier_delta(tier_before, scrape_tier(base_url))
    result.update(label=args.label, model_id=model, base_url=base_url, prompt_format=args.prompt_format,
                  max_concurrency=args.max_concurrency)
    print(format_report(result))
    if args.save_result:
        result["requests"] = [asdict(t) for t in traces]
        with open(args.save_result, "w") as f:
            json.dump(result, f, indent=2)
        print(f"Saved result to {args.save_result}")
    return 0 if result["completed"] else 1

