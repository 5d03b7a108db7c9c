"""Turns the core's token ids into text and ``RequestOutput``s; finds stop strings.

A user request with ``n`` samples is ``n`` core requests (children); this is where they are
gathered back into one output. Stop strings are matched here, on text, and the children that hit
one are reported so the caller can abort them in the core.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Optional

from pagellm.core.sched_output import EngineCoreOutput, LogprobRow
from pagellm.engine.detokenizer import IncrementalDetokenizer
from pagellm.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
    SampleLogprobs,
)
from pagellm.sampling_params import SamplingParams


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every output carries everything so far
    DELTA = 1  # only what is new since the last output (streaming)
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclass
class _ChildState:
    index: int
    core_req_id: str
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: Optional[SampleLogprobs] = None
    cumulative_logprob: Optional[float] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[int | str] = None
    num_sent_tokens: int = 0
    num_sent_logprobs: int = 0
    finish_sent: bool = False  # DELTA mode: the output carrying finish_reason went out


@dataclass
class RequestState:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    children: list[_ChildState]
    output_kind: RequestOutputKind
    metrics: RequestMetrics
    prompt_logprobs: Optional[PromptLogprobs] = None
    num_sent_prompt_logprobs: int = 0
    num_cached_tokens: int = 0
    error: Optional[str] = None
    # A pooling request: one EmbeddingRequestOutput when it finishes, whatever the output kind.
    pooling: bool = False
    pooled: Optional[list[float]] = None

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children)


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState] = {}
        self.child_to_parent: dict[str, tuple[str, int]] = {}
        self._token_text_cache: dict[int, str] = {}

    def add_request(
        self,
        request_id: str,
        prompt: Optional[str],
        prompt_token_ids: list[int],
        child_params: list[tuple[str, SamplingParams]],
        output_kind: RequestOutputKind,
        arrival_time: Optional[float] = None,
        pooling: bool = False,
    ) -> RequestState:
        if request_id in self.request_states:
            raise ValueError(f"request id {request_id!r} is already in use")
        children = []
        for index, (core_req_id, params) in enumerate(child_params):
            detok = IncrementalDetokenizer.from_sampling_params(self.tokenizer, prompt_token_ids, params)
            child = _ChildState(index, core_req_id, params, detok)
            if params.logprobs is not None:
                child.logprobs, child.cumulative_logprob = [], 0.0
            children.append(child)
            self.child_to_parent[core_req_id] = (request_id, index)
        first = child_params[0][1]
        state = RequestState(
            request_id,
            prompt,
            prompt_token_ids,
            children,
            output_kind,
            RequestMetrics(arrival_time if arrival_time is not None else time.monotonic()),
            prompt_logprobs=[None] if first.prompt_logprobs is not None else None,
            pooling=pooling,
        )
        self.request_states[request_id] = state
        return state

    def abort_request(self, request_id: str) -> tuple[list[str], Optional[RequestOutput]]:
        """Forgets a request: the core ids of its children still running, and its final output
        (finish_reason "abort" for each of those children), or ([], None) if it is unknown."""
        state = self.request_states.pop(request_id, None)
        if state is None:
            return [], None
        for c in state.children:
            self.child_to_parent.pop(c.core_req_id, None)
        running = [c for c in state.children if c.finish_reason is None]
        final = RequestOutput(
            request_id=request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=[CompletionOutput(index=c.index, text="", token_ids=[], finish_reason="abort") for c in running],
            finished=True,
            num_cached_tokens=state.num_cached_tokens,
            metrics=state.metrics,
        )
        return [c.core_req_id for c in running], final

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def process_outputs(
        self, core_outputs: list[EngineCoreOutput]
    ) -> tuple[list[RequestOutput | EmbeddingRequestOutput], list[str]]:
        """Returns the outputs ready for their callers, and core ids to abort."""
        now = time.monotonic()
        touched: dict[str, RequestState] = {}
        to_abort: list[str] = []
        for out in core_outputs:
            parent = self.child_to_parent.get(out.req_id)
            if parent is None:
                continue
            state = self.request_states[parent[0]]
            child = state.children[parent[1]]
            touched[state.request_id] = state
            self._process_child(state, child, out, now, to_abort)
        ready = []
        for state in touched.values():
            output = self._make_output(state)
            if output is not None:
                ready.append(output)
            if state.finished:
                state.metrics.finished_time = now
                self.abort_request(state.request_id)
        return ready, to_abort

    def _process_child(self, state: RequestState, child: _ChildState, out: EngineCoreOutput, now: float, to_abort: list[str]) -> None:
        if out.error is not None:
            state.error = out.error
        if out.pooled is not None:
            state.pooled = out.pooled
            state.num_cached_tokens = max(state.num_cached_tokens, out.num_cached_tokens)
        if out.scheduled_time is not None and state.metrics.first_scheduled_time is None:
            state.metrics.first_scheduled_time = out.scheduled_time
        if out.new_prompt_logprobs and state.prompt_logprobs is not None and child.index == 0:
            state.prompt_logprobs.extend(self._to_logprob_dicts(out.new_prompt_logprobs))
        if out.new_token_ids:
            if state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
            state.metrics.last_token_time = now
            state.num_cached_tokens = max(state.num_cached_tokens, out.num_cached_tokens)
        if child.finish_reason is not None:
            return
        new_token_ids = out.new_token_ids
        stop_str = None
        if new_token_ids:
            # A stop token id's own text is left out of the output, as vLLM does.
            # (The core only ever stops on token ids; stop strings are found here.)
            stop_terminated = out.finish_reason == "stop"
            if len(new_token_ids) > 1 and child.detokenizer.stop:
                # A speculative step brings several tokens: those after a stop string are dropped.
                for i, token_id in enumerate(new_token_ids):
                    last = i == len(new_token_ids) - 1
                    stop_str = child.detokenizer.update([token_id], stop_terminated=last and stop_terminated)
                    if stop_str is not None:
                        new_token_ids = new_token_ids[: i + 1]
                        break
            else:
                stop_str = child.detokenizer.update(new_token_ids, stop_terminated=stop_terminated)
        child.token_ids.extend(new_token_ids)
        if child.logprobs is not None and out.new_logprobs:
            rows = out.new_logprobs[: len(new_token_ids)]
            child.logprobs.extend(self._to_logprob_dicts(rows))
            child.cumulative_logprob += sum(row.logprobs[0] for row in rows)
        if stop_str is not None:
            child.finish_reason, child.stop_reason = "stop", stop_str
            if out.finish_reason is None:
                to_abort.append(child.core_req_id)
        elif out.finish_reason is not None:
            child.finish_reason, child.stop_reason = out.finish_reason, out.stop_reason

    def _decode_token(self, token_id: int) -> str:
        text = self._token_text_cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            if len(self._token_text_cache) < 200_000:
                self._token_text_cache[token_id] = text
        return text

    def _to_logprob_dicts(self, rows: list[LogprobRow]) -> list[dict[int, Logprob]]:
        dicts = []
        for token_ids, logprobs, rank in rows:
            d = {token_ids[0]: Logprob(logprobs[0], rank, self._decode_token(token_ids[0]))}
            for j in range(1, len(token_ids)):
                d.setdefault(token_ids[j], Logprob(logprobs[j], j, self._decode_token(token_ids[j])))
            dicts.append(d)
        return dicts

    def _make_output(self, state: RequestState) -> Optional[RequestOutput | EmbeddingRequestOutput]:
        kind = state.output_kind
        finished = state.finished
        if state.pooling:
            if not finished:
                return None
            return EmbeddingRequestOutput(
                request_id=state.request_id,
                outputs=EmbeddingOutput(state.pooled or []),
                prompt_token_ids=state.prompt_token_ids,
                finished=True,
                num_cached_tokens=state.num_cached_tokens,
                metrics=state.metrics,
                error=state.error if state.pooled is None else None,
            )
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind == RequestOutputKind.DELTA
        outputs = []
        for child in state.children:
            done = child.finish_reason is not None
            if delta:
                token_ids = child.token_ids[child.num_sent_tokens :]
                logprobs = child.logprobs[child.num_sent_logprobs :] if child.logprobs is not None else None
                child.num_sent_tokens = len(child.token_ids)
                if child.logprobs is not None:
                    child.num_sent_logprobs = len(child.logprobs)
                if not token_ids and (not done or child.finish_sent):
                    continue  # nothing new, or its end was already reported
                child.finish_sent = done
            else:
                token_ids, logprobs = list(child.token_ids), child.logprobs
            text = child.detokenizer.get_next_output_text(done, delta)
            outputs.append(
                CompletionOutput(
                    index=child.index,
                    text=text,
                    token_ids=token_ids,
                    cumulative_logprob=child.cumulative_logprob,
                    logprobs=logprobs,
                    finish_reason=child.finish_reason,
                    stop_reason=child.stop_reason,
                )
            )
        prompt_logprobs = state.prompt_logprobs
        if delta and prompt_logprobs is not None:
            prompt_logprobs = prompt_logprobs[state.num_sent_prompt_logprobs :]
            state.num_sent_prompt_logprobs = len(state.prompt_logprobs)
        if not outputs and not finished and not prompt_logprobs:
            return None
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=state.num_cached_tokens,
            metrics=state.metrics,
            error=state.error,
        )
