"""Bad input: explicit limits answer 400/413 in OpenAI's shape, and fuzzing finds no 500.

The fuzzing runs against a live server: schemathesis generates schema-valid and schema-violating
requests for every operation of its ``/openapi.json``; hypothesis then mutates valid bodies field
by field with arbitrary JSON, and sends raw byte strings. Every answer must be a non-5xx status,
every error must be in OpenAI's shape, every stream must end with ``[DONE]`` (a Responses API
stream with its completed or incomplete event), and the server must stay healthy with its block
pool whole. Examples are bounded in number (and each request by a short context), so the whole
module takes about a minute.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reliability_utils import API_KEY, AUTH, MODEL, assert_openai_error, run, start_server

from pagellm.engine.input_processor import InputProcessor
from pagellm.sampling_params import MAX_LOGPROBS, MAX_N, MAX_STOP_STRING_LEN, MAX_STOP_STRINGS, SamplingParams

VOCAB = 49152  # SmolLM2's
FUZZ_BODY_LIMIT = 64 << 10
# A 32-token context bounds the work any one fuzzed request can ask for (n <= 128 of <= 31 tokens).
FUZZ_SERVER_ARGS = [
    "--max-model-len", "32",
    "--num-kv-blocks", "64",
    "--max-num-seqs", "32",
    "--max-request-body-bytes", str(FUZZ_BODY_LIMIT),
    "--api-key", API_KEY,
    "--disable-uvicorn-access-log",
]
FUZZ_SETTINGS = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def fuzz_server():
    server = start_server(FUZZ_SERVER_ARGS)
    yield server
    server.stop_and_check()


def check_answer(status: int, headers: Any, content: bytes, server_url: str) -> None:
    """What every answer to any input must satisfy."""
    assert status < 500, (status, content[:500])
    content_type = headers.get("content-type", "")
    if status >= 400:
        body = json.loads(content)
        assert isinstance(body, dict) and set(body) == {"error"}, body
        err = body["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == status, err
        assert isinstance(err["message"], str) and err["message"]
    elif "text/event-stream" in content_type:
        events = [line[len("data: ") :] for line in content.decode().splitlines() if line.startswith("data: ")]
        assert events, content[-300:]
        if events[-1] == "[DONE]":
            for event in events[:-1]:
                parsed = json.loads(event)
                assert "error" not in parsed, parsed  # a valid request does not fail mid-stream
        else:
            # The Responses API ends on its own terminal event, as OpenAI's does: no [DONE].
            types = [json.loads(event)["type"] for event in events]
            assert types[-1] in ("response.completed", "response.incomplete"), content[-300:]
            assert "error" not in types and "response.failed" not in types, types
    elif "application/json" in content_type:
        json.loads(content)
    assert httpx.get(f"{server_url}/health", timeout=30).status_code == 200


# -- explicit limits ---------------------------------------------------------------------------------

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]

LIMIT_CASES = [
    # (path, body, status, message fragment)
    (COMPLETIONS, {"prompt": "x", "n": MAX_N + 1}, 400, f"between 1 and {MAX_N}"),
    (COMPLETIONS, {"prompt": "x", "n": 0}, 400, "n must be"),
    (CHAT, {"messages": MESSAGES, "n": 10**6}, 400, "n must be"),
    (COMPLETIONS, {"prompt": [[1]] * 9, "n": 128}, 400, "at most 1024 sequences"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 97}, 400, "maximum context length is 96"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens must be at least 1"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 10**30}, 400, "maximum context length"),
    (CHAT, {"messages": MESSAGES, "max_completion_tokens": 10**6}, 400, "maximum context length"),
    (COMPLETIONS, {"prompt": "x", "stop": ["s"] * (MAX_STOP_STRINGS + 1)}, 400, f"at most {MAX_STOP_STRINGS} stop strings"),
    (COMPLETIONS, {"prompt": "x", "stop": "s" * (MAX_STOP_STRING_LEN + 1)}, 400, f"at most {MAX_STOP_STRING_LEN} characters"),
    (COMPLETIONS, {"prompt": "x", "stop": [""]}, 400, "non-empty"),
    (COMPLETIONS, {"prompt": "word " * 200}, 400, "context length is 96 tokens"),
    (COMPLETIONS, {"prompt": list(range(1, 98))}, 400, "context length is 96 tokens"),
    # Far too long to fit: refused by length before it is tokenized (which would stall the engine thread).
    (COMPLETIONS, {"prompt": "a" * 20000}, 400, "characters long"),
    (CHAT, {"messages": [{"role": "user", "content": "a" * 20000}]}, 400, "characters long"),
    ("/tokenize", {"prompt": "a" * 20000}, 400, "characters long"),
    (CHAT, {"messages": [{"role": "user", "content": "word " * 200}]}, 400, "context length is 96 tokens"),
    (COMPLETIONS, {"prompt": "x", "logprobs": MAX_LOGPROBS + 1}, 400, f"[0, {MAX_LOGPROBS}]"),
    (COMPLETIONS, {"prompt": "x", "logprobs": -1}, 400, "logprobs must be"),
    (COMPLETIONS, {"prompt": "x", "prompt_logprobs": MAX_LOGPROBS + 1}, 400, "prompt_logprobs must be"),
    (CHAT, {"messages": MESSAGES, "logprobs": True, "top_logprobs": MAX_LOGPROBS + 1}, 400, "logprobs must be"),
    (COMPLETIONS, {"prompt": [-1]}, 400, "token id -1 is out of range"),
    (COMPLETIONS, {"prompt": [VOCAB]}, 400, f"token id {VOCAB} is out of range"),
    (COMPLETIONS, {"prompt": [[5, 2**70]]}, 400, "out of range"),
    (COMPLETIONS, {"prompt": [1.5]}, 400, "prompt"),
    (COMPLETIONS, {"prompt": []}, 400, "must not be empty"),
    (COMPLETIONS, {"prompt": ""}, 400, "empty"),
    ("/detokenize", {"tokens": [VOCAB]}, 400, "out of range"),
    (COMPLETIONS, {"prompt": "x", "logit_bias": {str(VOCAB): 1}}, 400, "outside the vocabulary"),
    (COMPLETIONS, {"prompt": "x", "logit_bias": {"1": 101}}, 400, "[-100, 100]"),
    (COMPLETIONS, {"prompt": "x", "stop_token_ids": [VOCAB], "min_tokens": 1}, 400, "outside the vocabulary"),
    (COMPLETIONS, {"prompt": "x", "top_k": 2**70}, 400, "top_k must be at most"),
    (COMPLETIONS, {"prompt": "x", "seed": 2**70}, 400, "seed must fit in 64 bits"),
    (COMPLETIONS, b'{"prompt": "x", "temperature": 1e400}', 400, "temperature must be a finite number"),
    (COMPLETIONS, b'{"prompt": "x", "top_p": NaN}', 400, "top_p must be a finite number"),
    (COMPLETIONS, {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (
        CHAT,
        {"messages": MESSAGES, "chat_template": "{% for i in range(99999) %}{% for j in range(99999) %}x{% endfor %}{% endfor %}"},
        400,
        "--trust-request-chat-template",
    ),
    (CHAT, {"messages": MESSAGES, "chat_template_kwargs": {"chat_template": "{{ 1 }}"}}, 400, "--trust-request-chat-template"),
    ("/tokenize", {"messages": MESSAGES, "chat_template": "{{ messages }}"}, 400, "--trust-request-chat-template"),
    (CHAT, {"messages": []}, 400, "must not be empty"),
    (
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}]},
        400,
        "only text parts",
    ),
    (COMPLETIONS, {"prompt": "x", "model": "/etc/passwd"}, 404, "does not exist"),
]


@pytest.mark.slow
@pytest.mark.parametrize("path, body, status, fragment", LIMIT_CASES, ids=[f"{i}-{c[2]}" for i, c in enumerate(LIMIT_CASES)])
def test_limits_answer_clear_4xx(main_server, path, body, status, fragment):
    if isinstance(body, bytes):  # JSON that json.dumps would refuse to write (NaN, overflowing numbers)
        resp = httpx.post(f"{main_server.url}{path}", content=body, headers={**AUTH, "content-type": "application/json"}, timeout=60)
    else:
        resp = httpx.post(f"{main_server.url}{path}", json=body, headers=AUTH, timeout=60)
    err = assert_openai_error(resp, status)
    assert fragment in err["message"], err
    assert httpx.get(f"{main_server.url}/health").status_code == 200


@pytest.mark.slow
def test_body_size_limit_is_413_with_or_without_content_length(main_server):
    url, limit = main_server.url, 256 << 10
    big = json.dumps({"prompt": "a" * (limit + 10)}).encode()
    headers = {**AUTH, "content-type": "application/json"}
    err = assert_openai_error(httpx.post(f"{url}{COMPLETIONS}", content=big, headers=headers, timeout=60), 413)
    assert str(limit) in err["message"] and err["type"] == "RequestEntityTooLargeError"

    def chunked():  # no Content-Length: the cap is enforced while reading
        for i in range(0, len(big), 8192):
            yield big[i : i + 8192]

    assert_openai_error(httpx.post(f"{url}{COMPLETIONS}", content=chunked(), headers=headers, timeout=60), 413)
    # Just under the limit is read and judged on its merits (here: too many tokens).
    ok_size = json.dumps({"prompt": "a " * 1000}).encode()
    assert_openai_error(httpx.post(f"{url}{COMPLETIONS}", content=ok_size, headers=headers, timeout=60), 400)


@pytest.mark.slow
@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt": "\xff\xfe", "max_tokens": 2}',  # invalid UTF-8 inside a string
        b"\xff\xfe\x00\x01",  # not text at all
        b'{"prompt": "\xc3\x28"}',  # a truncated 2-byte sequence
        b'{"prompt": "hi", "max_tokens": 2',  # truncated JSON
        b"[]",
        b'"just a string"',
        b"",
        b"null",
    ],
)
def test_undecodable_bodies_are_400(main_server, raw):
    resp = httpx.post(f"{main_server.url}{COMPLETIONS}", content=raw, headers={**AUTH, "content-type": "application/json"}, timeout=60)
    assert_openai_error(resp, 400)


def test_sampling_params_reject_values_that_would_overflow_the_batch():
    # These used to pass validation, then overflow the runner's int64 arrays mid-step and kill the engine.
    with pytest.raises(ValueError, match="top_k must be at most"):
        SamplingParams(top_k=2**63, temperature=1.0)
    with pytest.raises(ValueError, match="seed must fit in 64 bits"):
        SamplingParams(seed=2**64)
    assert SamplingParams(top_k=2**31 - 1).top_k == 2**31 - 1
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)


def test_request_chat_template_needs_the_operators_trust():
    from fake_engine import FakeEngine

    from pagellm.engine.async_llm import AsyncLLM
    from pagellm.entrypoints.metrics import EngineMetrics
    from pagellm.entrypoints.openai.api_server import build_app

    async def post(app, path: str, body: dict) -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.post(path, json=body)

    body = {"messages": MESSAGES, "max_tokens": 2, "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"}
    for trust, status in ((False, 400), (True, 200)):
        engine = FakeEngine(max_model_len=64)
        metrics = EngineMetrics(engine.model_name)
        llm = AsyncLLM(engine, stat_logger=metrics)
        app = build_app(llm, metrics, trust_request_chat_template=trust)
        try:
            for path in (CHAT, "/tokenize"):
                resp = run(post(app, path, body))
                assert resp.status_code == status, resp.text
                if status == 400:
                    assert resp.json()["error"]["param"] == "chat_template"
        finally:
            llm.shutdown()


def test_input_processor_refuses_text_too_long_to_fit_before_tokenizing():
    class Tokenizer:
        def get_vocab(self):
            return {"a": 0, "abcd": 1, "<0x0A>": 2}

        def encode(self, text, add_special_tokens=True):
            raise AssertionError("must not be called for text this long")

    processor = InputProcessor(Tokenizer(), max_model_len=10, vocab_size=3, eos_token_ids=set())
    assert processor.max_prompt_chars == 2 * 10 * 6  # at most 6 characters per token
    with pytest.raises(ValueError, match="121 characters long"):
        processor.tokenize("x" * 121)


def test_input_processor_rejects_out_of_vocabulary_ids():
    """The offline path (LLM.generate -> InputProcessor) checks what the server checks."""
    processor = InputProcessor(tokenizer=None, max_model_len=64, vocab_size=100, eos_token_ids={2})
    ok = processor.process({"prompt_token_ids": [1, 2, 3]}, SamplingParams(logit_bias={99: 1.0}, stop_token_ids=[0]))
    assert ok.prompt_token_ids == [1, 2, 3]
    with pytest.raises(ValueError, match="logit_bias token id 100 is outside the vocabulary"):
        processor.process({"prompt_token_ids": [1]}, SamplingParams(logit_bias={100: 1.0}))
    with pytest.raises(ValueError, match="logit_bias token id -1"):
        processor.process({"prompt_token_ids": [1]}, SamplingParams(logit_bias={-1: 1.0}))
    with pytest.raises(ValueError, match="stop_token_ids token id 5000"):
        processor.process({"prompt_token_ids": [1]}, SamplingParams(stop_token_ids=[5000]))


@pytest.mark.slow
def test_offline_llm_rejects_out_of_vocabulary_logit_bias_before_queueing():
    from pagellm import LLM

    llm = LLM(max_model_len=64, num_kv_blocks=16)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate(
            ["Hello", "World"], [SamplingParams(max_tokens=2), SamplingParams(max_tokens=2, logit_bias={VOCAB: 5.0})], use_tqdm=False
        )
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate("Hello", SamplingParams(max_tokens=2, temperature=0, logit_bias={VOCAB - 1: 1.0}), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


# -- fuzzing -------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_schemathesis_fuzz_every_operation(fuzz_server):
    schemathesis = pytest.importorskip("schemathesis")
    from schemathesis import GenerationMode

    url = fuzz_server.url
    schema = schemathesis.openapi.from_dict(httpx.get(f"{url}/openapi.json").json())
    operations = [result.ok() for result in schema.get_all_operations()]
    operations = [op for op in operations if not op.path.startswith("/debug")]  # the test instrument
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize"}
    statuses: dict[int, int] = {}
    num_cases = 0
    for op in operations:
        has_body = op.method.upper() == "POST"
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if has_body else (GenerationMode.POSITIVE,):

            @settings(max_examples=50 if has_body else 3, **FUZZ_SETTINGS)
            @given(case=op.as_strategy(mode))
            def fuzz(case):
                nonlocal num_cases
                resp = case.call(base_url=url, headers=AUTH, timeout=120)
                statuses[resp.status_code] = statuses.get(resp.status_code, 0) + 1
                num_cases += 1
                headers = {k: v[0] if isinstance(v, list) else v for k, v in resp.headers.items()}
                check_answer(resp.status_code, headers, resp.content, url)

            fuzz()
    assert num_cases >= 400 and statuses.get(200, 0) > 0 and statuses.get(400, 0) > 0, statuses


def json_values(max_leaves: int = 6):
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.sampled_from([0, 1, -1, 2, 31, 32, 33, 128, 129, 2**31, 2**63, VOCAB, VOCAB - 1]),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=40),
        st.sampled_from(["", "\udcff", "\x00", "<|im_end|>", "<|endoftext|>", "{{ 7*7 }}", "a" * 2000, "🙂" * 50]),
    )
    return st.recursive(
        scalars,
        lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
        max_leaves=max_leaves,
    )


VALID_BODIES = {
    COMPLETIONS: {"model": MODEL, "prompt": "Hello", "max_tokens": 4},  # sampled: greedy would neutralise top_k etc.
    CHAT: {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4},
    "/tokenize": {"model": MODEL, "prompt": "Hello"},
    "/detokenize": {"model": MODEL, "tokens": [1, 2, 3]},
}
FIELDS = {
    COMPLETIONS: [
        "prompt",
        "max_tokens",
        "n",
        "stop",
        "logprobs",
        "echo",
        "stream",
        "stream_options",
        "logit_bias",
        "seed",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "min_tokens",
        "stop_token_ids",
        "prompt_logprobs",
        "best_of",
        "suffix",
        "add_special_tokens",
        "cache_salt",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "include_stop_str_in_output",
        "skip_special_tokens",
        "ignore_eos",
        "model",
    ],
    CHAT: [
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "n",
        "logprobs",
        "top_logprobs",
        "stream",
        "stream_options",
        "stop",
        "echo",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template_kwargs",
        "cache_salt",
        "seed",
        "temperature",
        "logit_bias",
        "min_tokens",
        "stop_token_ids",
        "add_special_tokens",
        "model",
    ],
    "/tokenize": ["prompt", "messages", "add_special_tokens", "add_generation_prompt", "return_token_strs", "chat_template_kwargs"],
    "/detokenize": ["tokens", "model"],
}


# Boundary values for every field: type confusions, int32/int64 edges, the vocabulary's edge, huge,
# tiny and negative numbers, odd strings, and containers of them.
EDGE_VALUES = [
    None,
    True,
    0,
    1,
    -1,
    33,
    129,
    VOCAB - 1,
    VOCAB,
    2**31 - 1,
    2**31,
    2**63 - 1,
    2**63,
    -(2**63) - 1,
    10**30,
    0.5,
    -0.5,
    1e-300,
    1e308,
    "",
    "\udcff",
    "a" * 2000,
    [],
    [-1],
    [VOCAB],
    [2**63],
    [[1]],
    {},
    {"1": 1},
    {str(VOCAB): 1},
]


def check_status_only(status: int, content: bytes) -> None:
    assert status < 500, (status, content[:500])
    if status >= 400:
        err = json.loads(content)["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == status, err


@pytest.mark.slow
def test_every_field_at_every_edge_value(fuzz_server):
    """A deterministic sweep: each field of each body set to each boundary value, one at a time."""
    url = fuzz_server.url
    cases = [(path, field, value) for path in sorted(VALID_BODIES) for field in FIELDS[path] for value in EDGE_VALUES]

    async def sweep():
        limit = asyncio.Semaphore(6)
        async with httpx.AsyncClient(timeout=120) as client:

            async def one(path: str, field: str, value: Any) -> tuple[int, bytes]:
                body = {**VALID_BODIES[path], field: value}
                async with limit:
                    resp = await client.post(
                        f"{url}{path}", content=json.dumps(body).encode(), headers={**AUTH, "content-type": "application/json"}
                    )
                return resp.status_code, resp.content

            return await asyncio.gather(*(one(*case) for case in cases))

    answers = run(sweep())
    failures = []
    for case, (status, content) in zip(cases, answers):
        try:
            check_status_only(status, content)
        except (AssertionError, KeyError, ValueError) as e:
            failures.append((case[0], case[1], repr(case[2])[:40], status, content[:200], e))
    assert not failures, failures[:10]
    assert {status for status, _ in answers} >= {200, 400}
    assert httpx.get(f"{url}/health").status_code == 200


@st.composite
def mutated_requests(draw):
    path = draw(st.sampled_from(sorted(VALID_BODIES)))
    body = dict(VALID_BODIES[path])
    for field in draw(st.lists(st.sampled_from(FIELDS[path]), min_size=1, max_size=3, unique=True)):
        if draw(st.booleans()) and field in body:
            del body[field]
        else:
            body[field] = draw(st.one_of(st.sampled_from(EDGE_VALUES), json_values()))
    if path == COMPLETIONS and draw(st.booleans()):
        # Keep some bodies cheap but deep: valid shape, odd values.
        body.setdefault("max_tokens", 4)
    return path, body


@pytest.mark.slow
def test_mutated_valid_bodies_never_500(fuzz_server):
    url = fuzz_server.url
    seen: dict[int, int] = {}

    @settings(max_examples=250, **FUZZ_SETTINGS)
    @given(request=mutated_requests())
    def fuzz(request):
        path, body = request
        # ensure_ascii writes lone surrogates as \udcff escapes, as a client in any language could.
        content = json.dumps(body).encode()
        resp = httpx.post(f"{url}{path}", content=content, headers={**AUTH, "content-type": "application/json"}, timeout=120)
        seen[resp.status_code] = seen.get(resp.status_code, 0) + 1
        check_answer(resp.status_code, resp.headers, resp.content, url)

    fuzz()
    assert seen.get(200, 0) > 0 and seen.get(400, 0) > 0, seen


@pytest.mark.slow
def test_raw_bodies_never_500(fuzz_server):
    url = fuzz_server.url

    @settings(max_examples=150, **FUZZ_SETTINGS)
    @given(
        path=st.sampled_from([COMPLETIONS, CHAT, "/tokenize", "/detokenize"]),
        raw=st.one_of(st.binary(max_size=300), json_values().map(lambda v: json.dumps(v).encode())),
        content_type=st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded", ""]),
    )
    def fuzz(path, raw, content_type):
        headers = {**AUTH, "content-type": content_type} if content_type else AUTH
        resp = httpx.post(f"{url}{path}", content=raw, headers=headers, timeout=60)
        check_answer(resp.status_code, resp.headers, resp.content, url)

    fuzz()
