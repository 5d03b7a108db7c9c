"""A small model of the same vocabulary drafting for the target, in a paged KV cache of its own.

The draft's cache has the target's blocks (same ids, same block size), so the target's block
tables serve it unchanged. The draft computes its KV lazily, only for requests that draft: a
proposal first runs the draft over the request's tokens it has not seen (its prompt, the first
time; afterwards the one or two tokens the last verification added), then k - 1 single-token
passes, writing KV ahead of the verified tokens (the scheduler allocates that lookahead). Which
of those positions hold the real tokens is learned at the next proposal, by comparing the drafts
fed with the tokens the target accepted. A request that never drafts (a wide batch) costs the
draft nothing. Draft KV only ever shapes proposals, never outputs: verification keeps those
exact whatever the draft computed, so a prefix-cached block's draft KV is simply rewritten.

Random requests draw each draft from the draft's softmax at their temperature, kept for the
rejection sampler.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from pagellm.attention.backend import AttentionMetadata
from pagellm.sample.sampler import derive_step_seed
from pagellm.worker.input_batch import InputBatch

# Keeps the draft's random stream apart from the target's for a seeded request.
_DRAFT_SEED_SALT = 0x5EED_D4AF


@dataclass
class _DraftState:
    num_computed: int  # leading positions whose draft KV holds the request's real tokens
    fed_draft_ids: tuple[int, ...] = ()  # drafts fed after those, at positions num_computed...


class DraftModelProposer:
    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], block_size: int) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = kv_caches[0].device
        self._probs: dict[str, torch.Tensor] = {}
        self._states: dict[str, _DraftState] = {}
        self._generator = torch.Generator(device=self.device)
        # Seconds of one single-token pass over the drafting requests in the last proposal (None:
        # it had none), what the scheduler weighs a draft position at; catching up is left out.
        self.last_pass_seconds: Optional[float] = None

    def remove_request(self, req_id: str) -> None:
        """Finished or preempted: a resumed request's blocks are new, its draft KV starts over."""
        self._states.pop(req_id, None)
        self._probs.pop(req_id, None)

    def draft_probs_for(self, req_id: str, num_drafts: int) -> Optional[torch.Tensor]:
        """The distributions a random request's drafts were drawn from (None: greedy drafts)."""
        probs = self._probs.get(req_id)  # kept until the next proposal: a failed batch retries per request
        return probs[:num_drafts] if probs is not None else None

    def _num_computed(self, req_id: str, row: int, batch: InputBatch) -> int:
        state = self._states.get(req_id)
        if state is None:
            return 0
        n = state.num_computed
        real = batch.token_ids[row, n : min(n + len(state.fed_draft_ids), int(batch.num_tokens[row]))].tolist()
        valid = 0
        while valid < len(real) and real[valid] == state.fed_draft_ids[valid]:
            valid += 1
        return n + valid

    def propose_batch(self, batch: InputBatch, requests: list[tuple[str, int, int]]) -> dict[str, list[int]]:
        """Up to k drafts for each ``(req_id, row, k)``, from the row's last known token on."""
        self._probs.clear()
        rows = np.array([row for _, row, _ in requests], dtype=np.int64)
        wanted = np.array([k for _, _, k in requests], dtype=np.int64)
        num_tokens = batch.num_tokens[rows].copy()
        # First pass: each request's unseen tokens (at least its last one), one chunk per request.
        starts = np.array([min(self._num_computed(r, row, batch), int(n) - 1) for (r, row, _), n in zip(requests, num_tokens)])
        t0 = time.perf_counter()
        logits = self._forward(rows, starts, num_tokens, batch)
        first_pass_s = time.perf_counter() - t0 if bool((starts == num_tokens - 1).all()) else None
        pass_times = [first_pass_s] if first_pass_s is not None else []
        drafts: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        tokens = np.zeros(len(requests), dtype=np.int64)
        for i in range(len(requests)):
            tokens[i] = self._draw(logits[i], int(rows[i]), batch, 0, probs[i])
            drafts[i].append(int(tokens[i]))
        positions = num_tokens.copy()  # where each request's newest draft goes, if fed
        for step in range(1, int(wanted.max())):
            active = np.flatnonzero(wanted > step)
            t0 = time.perf_counter()
            logits = self._forward(rows[active], positions[active], positions[active] + 1, batch, tokens[active])
            if len(active) == len(requests):
                pass_times.append(time.perf_counter() - t0)
            for j, i in enumerate(active.tolist()):
                tokens[i] = self._draw(logits[j], int(rows[i]), batch, step, probs[i])
                drafts[i].append(int(tokens[i]))
            positions[active] += 1
        self.last_pass_seconds = sum(pass_times) / len(pass_times) if pass_times else None
        for i, (req_id, _, k) in enumerate(requests):
            # Fed (their KV written): every draft but the last.
            self._states[req_id] = _DraftState(int(num_tokens[i]), tuple(drafts[i][: k - 1]))
            if probs[i]:
                self._probs[req_id] = torch.stack(probs[i])
        return {req_id: d for (req_id, _, _), d in zip(requests, drafts)}

    def _forward(
        self, rows: np.ndarray, starts: np.ndarray, ends: np.ndarray, batch: InputBatch, tokens: Optional[np.ndarray] = None
    ) -> torch.Tensor:
        """Runs positions ``starts[i] .. ends[i] - 1`` of each row (their ids from the batch, or
        ``tokens`` for one-token chunks past it) and returns the logits at each chunk's end."""
        dev = self.device
        lens = ends - starts
        cu = np.concatenate(([0], np.cumsum(lens)))
        seq = np.repeat(np.arange(len(rows)), lens)
        positions = starts[seq] + (np.arange(int(cu[-1])) - cu[:-1][seq])
        ids = tokens if tokens is not None else batch.token_ids[rows[seq], positions]
        table = batch.block_table
        slots = table[rows[seq], positions // self.block_size].astype(np.int64) * self.block_size + positions % self.block_size
        max_blocks = int(-(-ends.max() // self.block_size))
        metadata = AttentionMetadata(
            query_start_loc=torch.from_numpy(cu.astype(np.int32)).to(dev),
            seq_lens=torch.from_numpy(ends.astype(np.int32)).to(dev),
            block_table=torch.from_numpy(np.ascontiguousarray(table[rows, :max_blocks])).to(dev),
            slot_mapping=torch.from_numpy(slots).to(dev),
            max_query_len=int(lens.max()),
            max_seq_len=int(ends.max()),
            query_start_loc_cpu=cu.tolist(),
            seq_lens_cpu=ends.tolist(),
        )
        ids_t = torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64)).to(dev)
        hidden = self.model(ids_t, torch.from_numpy(np.ascontiguousarray(positions)).to(dev), self.kv_caches, metadata)
        return self.model.compute_logits(hidden[torch.from_numpy(cu[1:] - 1).to(dev)]).float()

    def _draw(self, logits: torch.Tensor, row: int, batch: InputBatch, step: int, probs: list[torch.Tensor]) -> int:
        if batch.greedy[row]:
            return int(logits.argmax())
        q = torch.softmax(logits / max(float(batch.temperature[row]), 1e-5), dim=-1)
        params = batch.params[row]
        generator = None
        if params is not None and params.seed is not None:
            generator = self._generator
            generator.manual_seed(derive_step_seed(params.seed ^ _DRAFT_SEED_SALT, batch.num_output_tokens(row) + step))
        probs.append(q)
        return int(torch.multinomial(q, 1, generator=generator))


def load_draft_model(
    model_path: str,
    hf_config,
    attn_backend,
    *,
    dtype: torch.dtype,
    device: torch.device,
    precision,
    packed_weight_cache: bool = False,
):
    """The draft checkpoint as the engine runs it, at the precision resolved for it (its own
    checkpoint's: a GGUF draft keeps its int8 blocks under a float32 target). Its vocabulary and
    layers were checked when the configuration was resolved, before anything loaded."""
    from pagellm.kernels.tuning import measure_cpu_tuning
    from pagellm.models.loader import load_model

    model = load_model(model_path, hf_config, dtype, device, attn_backend, precision, packed_weight_cache)
    model.kernels.tuning = measure_cpu_tuning(device, model.packed_weights())
    return model
