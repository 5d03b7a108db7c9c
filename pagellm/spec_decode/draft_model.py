"""A small model of the same vocabulary drafting for the target, in a paged KV cache of its own.

The draft's cache has the target's blocks (same ids, same block size), so the target's block
tables, prefix cache and preemption serve it unchanged: it runs on every token the target runs
on (``run_batch``, the same flat batch), which keeps its KV complete up to the target's, and a
block shared through the prefix cache holds both models' KV of the same tokens. After a step,
``propose_batch`` runs it k times over one token per drafting request, writing KV ahead of the
verified tokens (the scheduler allocates that lookahead). Random requests draw each draft from
the draft's softmax at their temperature and keep it for the rejection sampler.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from pagellm.attention.backend import AttentionMetadata
from pagellm.sample.sampler import derive_step_seed
from pagellm.worker.input_batch import InputBatch

# Keeps the draft's random stream apart from the target's for a seeded request.
_DRAFT_SEED_SALT = 0x5EED_D4AF


class DraftModelProposer:
    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], block_size: int) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = kv_caches[0].device
        self._probs: dict[str, torch.Tensor] = {}
        self._generator = torch.Generator(device=self.device)

    def run_batch(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: list[AttentionMetadata]) -> None:
        """The target's step through the draft: only its KV is kept."""
        self.model(input_ids, positions, self.kv_caches, metadata[0])

    def draft_probs_for(self, req_id: str, num_drafts: int) -> Optional[torch.Tensor]:
        """The distributions a random request's drafts were drawn from (None: greedy drafts)."""
        probs = self._probs.pop(req_id, None)
        return probs[:num_drafts] if probs is not None else None

    def propose_batch(self, batch: InputBatch, requests: list[tuple[str, int, int]]) -> dict[str, list[int]]:
        """Up to k drafts for each ``(req_id, row, k)``, from the row's last known token on."""
        self._probs.clear()
        rows = np.array([row for _, row, _ in requests], dtype=np.int64)
        wanted = np.array([k for _, _, k in requests], dtype=np.int64)
        positions = batch.num_tokens[rows] - 1
        tokens = batch.token_ids[rows, positions]
        drafts: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        for step in range(int(wanted.max())):
            active = np.flatnonzero(wanted > step)
            logits = self._decode(rows[active], tokens[active], positions[active], batch)
            for j, i in enumerate(active.tolist()):
                token = self._draw(logits[j], int(rows[i]), batch, step, probs[i])
                drafts[i].append(token)
                tokens[i] = token
            positions[active] += 1
        for (req_id, _, _), p in zip(requests, probs):
            if p:
                self._probs[req_id] = torch.stack(p)
        return {req_id: d for (req_id, _, _), d in zip(requests, drafts)}

    def _decode(self, rows: np.ndarray, tokens: np.ndarray, positions: np.ndarray, batch: InputBatch) -> torch.Tensor:
        dev = self.device
        seq_lens = positions + 1
        max_blocks = int(-(-seq_lens.max() // self.block_size))
        table = batch.block_table
        slots = table[rows, positions // self.block_size].astype(np.int64) * self.block_size + positions % self.block_size
        num = len(rows)
        metadata = AttentionMetadata(
            query_start_loc=torch.arange(num + 1, dtype=torch.int32, device=dev),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev),
            block_table=torch.from_numpy(np.ascontiguousarray(table[rows, :max_blocks])).to(dev),
            slot_mapping=torch.from_numpy(slots).to(dev),
            max_query_len=1,
            max_seq_len=int(seq_lens.max()),
            query_start_loc_cpu=list(range(num + 1)),
            seq_lens_cpu=seq_lens.tolist(),
        )
        ids = torch.from_numpy(np.ascontiguousarray(tokens)).to(dev)
        hidden = self.model(ids, torch.from_numpy(np.ascontiguousarray(positions)).to(dev), self.kv_caches, metadata)
        return self.model.compute_logits(hidden).float()

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


def load_draft_model(config, model_path: str, attn_backend, target_vocab_size: int):
    """The draft checkpoint as the engine runs it, at its own checkpoint's precision (a GGUF
    draft keeps its int8 blocks under a float32 target), and its shape. ValueError when its
    vocabulary is not the target's."""
    from pagellm.config import model_dtype
    from pagellm.kernels.tuning import measure_cpu_tuning
    from pagellm.models.loader import is_gguf, load_hf_config, load_model, resolve_model_path
    from pagellm.models.precision import draft_linear_precision
    from pagellm.models.shape import ModelShape

    hf_config = load_hf_config(model_path)
    shape = ModelShape.from_hf_config(hf_config)
    if shape.vocab_size != target_vocab_size:
        raise ValueError(
            f"the draft model {model_path!r} has a vocabulary of {shape.vocab_size} tokens, the target {target_vocab_size}: "
            "a draft must share the target's tokenizer"
        )
    if any(w is not None for w in shape.layer_sliding_windows):
        raise ValueError("a draft model with sliding-window layers is not supported; use a full-attention draft")
    precision = draft_linear_precision(config, model_dtype(hf_config), is_gguf(resolve_model_path(model_path)))
    model = load_model(model_path, hf_config, config.dtype, config.device, attn_backend, precision)
    model.use_cpu_tuning(measure_cpu_tuning(config.device, model.packed_weights(), attention=False))
    return model, shape
