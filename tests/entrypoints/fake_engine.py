"""A model-free stand-in for ``LLMEngine``: same interface as ``AsyncLLM`` uses, one token per step.

Request i's output token j is ``j``; its text is ``"t{j} "``. Prompts are strings, one token per
character; the prompt ``"bad"`` is rejected with ValueError, as real validation would.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Optional

from pagellm.core.scheduler import SchedulerStats
from pagellm.engine.input_processor import ProcessedPrompt
from pagellm.engine.stats import EngineStats
from pagellm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagellm.sampling_params import SamplingParams


class FakeTokenizer:
    # None like a base model's; tests that chat set any string to enable the toy template below.
    chat_template = None

    def apply_chat_template(self, messages, add_generation_prompt=True, chat_template=None, tokenize=False, **kwargs) -> str:
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 1000 for c in text]

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        return "".join(chr(i) for i in ids)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [chr(i) for i in ids]


@dataclass
class _Child:
    index: int
    finish_reason: Optional[str] = None


@dataclass
class FakeState:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    metrics: RequestMetrics
    children: list[_Child] = field(default_factory=list)
    num_generated: int = 0
    num_cached_tokens: int = 0


class FakeInputProcessor:
    def __init__(self, tokenizer: FakeTokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = 1000

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text)

    def validate_token_ids(self, token_ids: list[int]) -> None:
        if any(not 0 <= t < 1000 for t in token_ids):
            raise ValueError("token id out of range")


class FakeEngine:
    def __init__(
        self,
        max_model_len: int = 64,
        step_delay_s: float = 0.0,
        max_waiting_requests: Optional[int] = None,
        prefault_slices: int = 0,
        prefault_delay_s: float = 0.0,
    ) -> None:
        self.config = SimpleNamespace(max_waiting_requests=max_waiting_requests, runner="generate")
        self.tokenizer = FakeTokenizer()
        self.model_name = "fake-model"
        self.model_path = "/nowhere/fake-model"
        self.max_model_len = max_model_len
        self.input_processor = FakeInputProcessor(self.tokenizer, max_model_len)
        self.step_delay_s = step_delay_s
        self.states: dict[str, FakeState] = {}
        # The number of waiting requests AsyncLLM reads (through stats()) to enforce max_waiting_requests.
        self.num_waiting = 0
        self.num_steps = 0
        self.aborted: list[str] = []
        self.crash_on_step: Optional[int] = None
        self.step_threads: set[str] = set()
        self.gate = threading.Event()  # steps only run while set (tests can hold the engine)
        self.gate.set()
        # Idle-time KV prefaulting: slices left, and each slice's (thread, requests in flight).
        self.prefault_slices_left = prefault_slices
        self.prefault_delay_s = prefault_delay_s
        self.prefault_calls: list[tuple[str, int]] = []

    def prefault_kv_cache(self) -> bool:
        self.prefault_calls.append((threading.current_thread().name, len(self.states)))
        if self.prefault_delay_s:
            time.sleep(self.prefault_delay_s)
        self.prefault_slices_left = max(0, self.prefault_slices_left - 1)
        return self.prefault_slices_left > 0

    def stats(self) -> EngineStats:
        n = len(self.states)
        return EngineStats(SchedulerStats(n, self.num_waiting, 0.1 * bool(n), 100, n, 0, 0, 0, 0, n, n))

    def process_prompt(self, prompt: Any, params: SamplingParams) -> ProcessedPrompt:
        if isinstance(prompt, dict):
            text, ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
        else:
            text, ids = prompt, self.tokenizer.encode(prompt)
        if prompt == "bad":
            raise ValueError("the prompt 'bad' is not allowed")
        max_tokens = params.max_tokens or self.max_model_len - len(ids)
        if len(ids) + max_tokens > self.max_model_len:
            raise ValueError(f"prompt + max_tokens exceed max_model_len={self.max_model_len}")
        return ProcessedPrompt(text, ids, max_tokens)

    def add_request(self, request_id, prompt, params, output_kind, arrival_time=None, processed=None, lora_request=None):
        if request_id in self.states:
            raise ValueError(f"request id {request_id!r} is already in use")
        processed = processed or self.process_prompt(prompt, params)
        state = FakeState(
            request_id,
            processed.prompt,
            processed.prompt_token_ids,
            params,
            processed.max_tokens,
            RequestMetrics(arrival_time or time.monotonic()),
            [_Child(i) for i in range(params.n)],
        )
        self.states[request_id] = state

    def abort_request(self, request_ids) -> list[RequestOutput]:
        finals = []
        for request_id in request_ids:
            state = self.states.pop(request_id, None)
            if state is not None:
                self.aborted.append(request_id)
                outputs = [CompletionOutput(c.index, "", [], finish_reason="abort") for c in state.children]
                finals.append(
                    RequestOutput(request_id, state.prompt, state.prompt_token_ids, outputs, True, metrics=state.metrics)
                )
        return finals

    def has_unfinished_requests(self) -> bool:
        return bool(self.states)

    def step(self) -> list[RequestOutput]:
        self.gate.wait()
        self.num_steps += 1
        self.step_threads.add(threading.current_thread().name)
        if self.crash_on_step is not None and self.num_steps >= self.crash_on_step:
            raise RuntimeError("injected engine failure")
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        now = time.monotonic()
        ready = []
        for request_id, state in list(self.states.items()):
            j = state.num_generated
            state.num_generated += 1
            done = state.num_generated >= state.max_tokens
            if state.metrics.first_scheduled_time is None:
                state.metrics.first_scheduled_time = now
            if state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
            state.metrics.last_token_time = now
            outputs = [
                CompletionOutput(c.index, f"t{j} ", [j], finish_reason="length" if done else None) for c in state.children
            ]
            if done:
                state.metrics.finished_time = now
                del self.states[request_id]
            ready.append(
                RequestOutput(request_id, state.prompt, state.prompt_token_ids, outputs, finished=done, metrics=state.metrics)
            )
        return ready
