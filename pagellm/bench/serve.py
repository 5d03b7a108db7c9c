"""``pagellm bench serve``: load-test any OpenAI-compatible server over HTTP.

    pagellm serve &                       # or vllm serve, or any /v1/completions server
    pagellm bench serve --base-url http://127.0.0.1:8000 --dataset-name random \\
        --num-prompts 200 --request-rate 4 --max-concurrency 32

Each sample is a streaming ``/v1/completions`` request with ``ignore_eos`` and ``max_tokens`` set
to its output length; the prompt goes as token ids (or decoded text with ``--prompt-format
text``). Arrivals follow a Poisson process at ``--request-rate`` (gamma with ``--burstiness``;
``inf`` sends all at once), at most ``--max-concurrency`` in flight. Timing and metrics follow
vLLM's ``vllm bench serve`` exactly (see ``metrics``), so the two tools' tables compare.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import time
from typing import Any, AsyncIterator, Optional, Sequence, Union

import httpx
import numpy as np
from tqdm.auto import tqdm

from pagellm.bench.common import add_result_args, save_result
from pagellm.bench.datasets import SampleRequest, add_dataset_args, get_samples, tokenizer_token_ids
from pagellm.bench.metrics import (
    METRIC_NAMES,
    RequestTrace,
    calculate_metrics,
    format_serving_table,
    parse_metric_names,
    parse_percentiles,
    result_dict,
)

Prompt = Union[str, list[int]]


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default=None, help="server root, e.g. http://127.0.0.1:8000")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--endpoint", default="/v1/completions")
    parser.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer for the prompts (default: the packaged model's)")
    parser.add_argument("--prompt-format", default="ids", choices=["ids", "text"], help="send token ids or decoded text")
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s; inf sends all at once")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps; 1 is Poisson")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=None, help="sent only when given")
    parser.add_argument(
        "--extra-body", type=json.loads, default=None, help='JSON merged into every request, e.g. \'{"response_format": {...}}\''
    )
    parser.add_argument("--percentile-metrics", default=",".join(METRIC_NAMES))
    parser.add_argument("--metric-percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    parser.add_argument("--disable-tqdm", action="store_true")
    parser.add_argument("--request-timeout", type=float, default=6 * 3600, help="seconds per request")
    add_dataset_args(parser, default_name="random", default_num_prompts=100)
    add_result_args(parser)


# ---- one request --------------------------------------------------------------------------


_SSE_LINE_END = re.compile(rb"\r\n|\r|\n")


async def _sse_lines(response: httpx.Response) -> AsyncIterator[str]:
    """The stream's lines, ended as the SSE spec ends them (CRLF, LF or CR) and by nothing else.

    Not ``aiter_lines()``: like ``str.splitlines()`` it also breaks at U+0085, U+2028 and U+2029,
    which JSON leaves unescaped inside strings, so generated text holding one would cut its chunk
    in two. Splitting the bytes is safe: no UTF-8 sequence contains a CR or LF byte.
    """
    pending = b""
    async for data in response.aiter_bytes():
        pending += data
        *lines, pending = _SSE_LINE_END.split(pending)
        for line in lines:
            yield line.decode("utf-8", errors="replace")
    if pending:
        yield pending.decode("utf-8", errors="replace")


async def _sse_data(response: httpx.Response) -> AsyncIterator[str]:
    """The payloads of a server-sent-event stream's ``data:`` lines; comments are skipped."""
    async for line in _sse_lines(response):
        line = line.strip()
        if not line or line.startswith(":"):
            continue
        if line.startswith("data:"):
            yield line[len("data:") :].strip()


class StreamError(Exception):
    """A completion stream that failed: an HTTP error status, or an error object in the stream."""


async def completion_messages(client: httpx.AsyncClient, url: str, payload: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    """The JSON messages of one streamed completion, up to ``[DONE]``; StreamError for an HTTP error
    answer (its body's start) or an in-band error."""
    async with client.stream("POST", url, json=payload) as response:
        if response.status_code != 200:
            body = (await response.aread()).decode(errors="replace")
            raise StreamError(f"HTTP {response.status_code}: {body[:500]}")
        async for data in _sse_data(response):
            if data == "[DONE]":
                continue
            message = json.loads(data)
            if message.get("error"):
                raise StreamError(str(message["error"]))
            yield message


def completion_payload(
    model: str, prompt: Prompt, output_len: int, temperature: Optional[float] = None, extra_body: Optional[dict] = None
) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if temperature is not None:
        payload["temperature"] = temperature
    payload.update(extra_body or {})
    return payload


async def request_completion(client: httpx.AsyncClient, url: str, payload: dict[str, Any], prompt_len: int) -> RequestTrace:
    """Streams one completion, timing chunks as vLLM's ``async_request_openai_completions``."""
    trace = RequestTrace(prompt_len=prompt_len)
    text_parts: list[str] = []
    st = time.perf_counter()
    trace.start_time = st
    last = st
    try:
        async for message in completion_messages(client, url, payload):
            choices = message.get("choices")
            if choices:
                now = time.perf_counter()
                if trace.num_chunks == 0:
                    trace.ttft = now - st
                else:
                    trace.itl.append(now - last)
                last = now
                trace.num_chunks += 1
                text_parts.append(choices[0].get("text") or "")
            # vLLM reads usage only from choice-less chunks; a server that puts it on the last
            # token's chunk is counted too.
            if message.get("usage"):
                trace.output_tokens = message["usage"].get("completion_tokens")
        trace.generated_text = "".join(text_parts)
        trace.latency = last - st
        if trace.num_chunks:
            trace.success = True
        else:
            trace.error = "the stream carried no completion chunk, so there is no TTFT; counted as failed"
    except StreamError as e:
        trace.error = str(e)
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        trace.error = f"{type(e).__name__}: {e}"
    return trace


# ---- the load ---------------------------------------------------------------------------


def arrival_offsets(num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times (seconds after the start) of each request.

    Gaps are gamma-distributed with mean 1/rate (exponential, i.e. Poisson arrivals, for
    burstiness 1), then scaled so the last request goes out at exactly ``num_requests / rate``,
    as vLLM does to keep throughput comparable across seeds.
    """
    if request_rate <= 0:
        raise ValueError(f"request rate must be positive, got {request_rate}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be positive, got {burstiness}")
    if request_rate == float("inf"):
        return [0.0] * num_requests
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests)
    offsets = np.cumsum(gaps)
    if num_requests and offsets[-1] > 0:
        offsets *= (num_requests / request_rate) / offsets[-1]
    return offsets.tolist()


async def get_first_model(client: httpx.AsyncClient, base_url: str) -> str:
    try:
        response = await client.get(f"{base_url}/v1/models")
        response.raise_for_status()
        data = response.json().get("data") or []
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        raise ValueError(f"could not list models at {base_url}/v1/models ({e}); is the server up? pass --model") from None
    if not data:
        raise ValueError(f"the server at {base_url} lists no models")
    return data[0]["id"]


async def benchmark(
    base_url: str,
    prompts: Sequence[Prompt],
    samples: Sequence[SampleRequest],
    model: Optional[str] = None,
    endpoint: str = "/v1/completions",
    request_rate: float = float("inf"),
    burstiness: float = 1.0,
    max_concurrency: Optional[int] = None,
    seed: int = 0,
    temperature: Optional[float] = None,
    extra_body: Optional[dict] = None,
    disable_tqdm: bool = False,
    request_timeout: float = 6 * 3600,
    transport: Optional[httpx.AsyncBaseTransport] = None,
) -> tuple[list[RequestTrace], float, str]:
    """Runs the load; returns each request's trace, the wall duration and the model used."""
    if len(prompts) != len(samples):
        raise ValueError("one prompt per sample is needed")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max concurrency must be positive, got {max_concurrency}")
    base_url = base_url.rstrip("/")
    url = base_url + endpoint
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(request_timeout), limits=limits, transport=transport) as client:
        model = model or await get_first_model(client, base_url)
        # One short request first, as vLLM does: a misconfigured run fails fast and clearly. Its
        # prompt is the end of the first one, so it warms no prefix cache the load then hits.
        probe_prompt = prompts[0][-8:] if isinstance(prompts[0], list) else prompts[0][-32:]
        probe = await request_completion(client, url, completion_payload(model, probe_prompt, 1, temperature, extra_body), 0)
        if not probe.success:
            raise ValueError(f"the test request to {url} failed: {probe.error}")
        offsets = arrival_offsets(len(samples), request_rate, burstiness, seed)
        semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        bar = tqdm(total=len(samples), disable=disable_tqdm, dynamic_ncols=True)

        async def one(i: int, start: float) -> RequestTrace:
            delay = start + offsets[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            payload = completion_payload(model, prompts[i], samples[i].output_len, temperature, extra_body)
            if semaphore is None:
                trace = await request_completion(client, url, payload, samples[i].prompt_len)
            else:
                async with semaphore:
                    trace = await request_completion(client, url, payload, samples[i].prompt_len)
            bar.update(1)
            return trace

        start = time.perf_counter()
        traces = await asyncio.gather(*(one(i, start) for i in range(len(samples))))
        duration = time.perf_counter() - start
        bar.close()
    return list(traces), duration, model


def main(args: argparse.Namespace) -> int:
    from pagellm.models.loader import default_model_path
    from pagellm.tokenizer import load_tokenizer

    base_url = args.base_url or f"http://{args.host}:{args.port}"
    percentiles = parse_percentiles(args.metric_percentiles)
    metric_names = parse_metric_names(args.percentile_metrics)
    tokenizer = load_tokenizer(args.tokenizer or default_model_path())
    samples = get_samples(args, tokenizer_token_ids(tokenizer), tokenizer=tokenizer)
    if args.prompt_format == "text":
        prompts: list[Prompt] = [tokenizer.decode(s.prompt_token_ids) for s in samples]
    else:
        prompts = [s.prompt_token_ids for s in samples]
    print(f"Traffic request rate: {args.request_rate}")
    print(f"Burstiness factor: {args.burstiness}")
    print(f"Maximum request concurrency: {args.max_concurrency}")
    traces, duration, model = asyncio.run(
        benchmark(
            base_url,
            prompts,
            samples,
            model=args.model,
            endpoint=args.endpoint,
            request_rate=args.request_rate,
            burstiness=args.burstiness,
            max_concurrency=args.max_concurrency,
            seed=args.seed,
            temperature=args.temperature,
            extra_body=args.extra_body,
            disable_tqdm=args.disable_tqdm,
            request_timeout=args.request_timeout,
        )
    )
    failed = [t for t in traces if not t.success]
    for i, t in enumerate(failed[:10]):
        print(f"Error {i}: {t.error}")
    metrics = calculate_metrics(traces, duration, percentiles)
    print(format_serving_table(metrics, duration, args.max_concurrency, args.request_rate, metric_names))
    result = result_dict(metrics, traces, duration, metric_names)
    result.update(
        model_id=model,
        dataset_name=args.dataset_name,
        num_prompts=args.num_prompts,
        request_rate=args.request_rate if args.request_rate != float("inf") else "inf",
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
    )
    rate = "inf" if args.request_rate == float("inf") else f"{args.request_rate:g}"
    save_result(result, args, f"serve-{rate}qps-{model.split('/')[-1]}")
    return 0 if metrics.completed else 1
