"""Turns a scheduler step into one forward pass over a flat, mixed batch, then samples.

The runner owns the model, the KV cache tensors and the persistent input batch. It never sees a
``Request``: only the scheduler's narrow step objects come in and plain token ids go out.
"""
from __future__ import annotations

import logging
import time
from typing import Optional, Union

import numpy as np
import torch

from pagellm.attention.backend import AttentionMetadata
from pagellm.attention.state_metadata import StateMetadata
from pagellm.core.kv_cache_groups import KVCacheLayout
from pagellm.core.kv_tier import is_state_key
from pagellm.core.sched_output import LogprobRow, ModelRunnerOutput, SchedulerOutput
from pagellm.distributed.parallel_state import get_tp_group
from pagellm.kernels import pack_cache
from pagellm.kv_offload.offloader import KVOffloader
from pagellm.lora.model_manager import LoRAModelManager
from pagellm.pooling_params import PoolerConfig
from pagellm.sample.logprobs import compute_prompt_logprobs
from pagellm.sample.metadata import LogprobsTensors
from pagellm.sample.rejection_sampler import RejectionSampler, SpecDecodeMetadata
from pagellm.sample.sampler import Sampler
from pagellm.structured_output import StructuredOutputManager
from pagellm.worker.cuda_graphs import DecodeGraphRunner, model_supports_cuda_graphs
from pagellm.worker.input_batch import InputBatch
from pagellm.worker.pooler import Pooler, pooling_chunks
from pagellm.worker.sampling_inputs import build_sampling_metadata

logger = logging.getLogger(__name__)


def _logprob_rows(tensors: LogprobsTensors, nums: list[int]) -> list[LogprobRow]:
    """Splits batched logprobs into per-row lists, each cut to the k its request asked for."""
    token_ids = tensors.token_ids.tolist()
    logprobs = tensors.logprobs.tolist()
    ranks = tensors.ranks.tolist()
    return [LogprobRow(token_ids[i][: k + 1], logprobs[i][: k + 1], ranks[i]) for i, k in enumerate(nums)]


class ModelRunner:
    """``kv_caches`` has one tensor per layer (layers in the same position of different KV cache
    groups share one). With one group the model gets one ``AttentionMetadata`` for all layers;
    with several (``kv_cache_layout``), a list with each layer's group's metadata. A hybrid model's
    recurrent layers take their state tensors in ``kv_caches`` and the step's ``StateMetadata``."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        block_size: int,
        max_num_reqs: int,
        max_model_len: int,
        vocab_size: int,
        enforce_eager: bool = False,
        structured_output: Optional[StructuredOutputManager] = None,
        calculate_kv_scales: bool = False,
        kv_cache_layout: Optional[KVCacheLayout] = None,
        drafter: Optional[object] = None,
        pooler_config: Optional[PoolerConfig] = None,
        lora_manager: Optional[LoRAModelManager] = None,
        offloader: Optional[KVOffloader] = None,
    ) -> None:
        self.model = model
        # Adapters' slots and each request's adapter; the step's segments are published through it.
        self.lora_manager = lora_manager
        self.offloader = offloader  # the offloading tier's pages in and out (pagellm.kv_offload)
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.num_kv_cache_groups = kv_cache_layout.num_groups if kv_cache_layout is not None else 1
        # A hybrid model's recurrent layers' state tensors (slot-indexed), for restoring checkpoints.
        self.state_caches: list[tuple[torch.Tensor, ...]] = []
        if kv_cache_layout is not None:
            self.state_caches = [kv_caches[layer] for layer in kv_cache_layout.state_layer_ids]
        self.device = next(c for c in kv_caches if isinstance(c, torch.Tensor)).device
        # Per layer, the group whose metadata it reads (None: one group, one metadata for all).
        self.layer_group_ids: Optional[tuple[int, ...]] = None
        if kv_cache_layout is not None and (
            kv_cache_layout.num_groups > 1 or kv_cache_layout.has_state or kv_cache_layout.has_layers_without_blocks
        ):
            if kv_cache_layout.num_layers != len(kv_caches):
                raise ValueError(f"a KV cache layout of {kv_cache_layout.num_layers} layers for {len(kv_caches)} KV caches")
            self.layer_group_ids = kv_cache_layout.layer_group_ids
        max_num_blocks_per_req = -(-max_model_len // block_size)
        self.input_batch = InputBatch(max_num_reqs, max_model_len, max_num_blocks_per_req, self.num_kv_cache_groups)
        self.sampler = Sampler()
        self.rejection_sampler = RejectionSampler(self.sampler)
        # The pooling runner's vectors (pagellm.worker.pooler); None: this runner only generates.
        self.pooler = Pooler(pooler_config.pooling_type) if pooler_config is not None else None
        # Speculative decoding's proposer (pagellm.spec_decode): ``propose_batch(batch, requests)``
        # drafts after each step; a draft model also has ``draft_probs_for``, the distributions
        # its drafts were drawn from, and ``remove_request``.
        self.drafter = drafter
        # Grammar state of constrained requests (None: this runner does not sample, or masks nothing).
        self.structured_output = structured_output
        # Seconds spent in each phase of the last step; cheap enough to always record.
        self.last_timings: dict[str, float] = {}
        # Decode steps replay CUDA graphs on a GPU; the CPU path never builds any.
        self.cuda_graphs: Optional[DecodeGraphRunner] = None
        if self.device.type == "cuda" and not enforce_eager and not self.state_caches and model_supports_cuda_graphs(model):
            # Each layer's fp8 scales on the device before capture: graphs hold their addresses,
            # and a copy to the device cannot happen inside a capture.
            for kv_scales in model.kv_scales():
                kv_scales.device_tensor(self.device)
            self.cuda_graphs = self._capture_cuda_graphs(max_num_reqs, max_num_blocks_per_req)
        if calculate_kv_scales:
            # Armed after the graphs' capture, whose padding batches must not be what is measured:
            # the first real step sets each layer's scales (in place, so graphs replay them).
            for kv_scales in model.kv_scales():
                kv_scales.calculate = True

    def _capture_cuda_graphs(self, max_num_reqs: int, max_num_blocks_per_req: int) -> Optional[DecodeGraphRunner]:
        from pagellm.worker.cuda_graphs import CudaGraphDevice

        t0 = time.perf_counter()
        graphs = DecodeGraphRunner(
            lambda ids, pos, md: self.model(ids, pos, self.kv_caches, self._layer_metadata(md)),
            max_num_reqs,
            max_num_blocks_per_req,
            self.max_model_len,
            self.device,
            CudaGraphDevice(),
            num_kv_cache_groups=self.num_kv_cache_groups,
        )
        try:
            with torch.inference_mode():
                graphs.capture_all()
        except Exception:  # a model that cannot be captured still serves, eagerly
            logger.exception("CUDA graph capture failed; decode steps run eagerly")
            return None
        logger.info("captured CUDA graphs for decode batch sizes %s in %.1f s", graphs.sizes, time.perf_counter() - t0)
        return graphs

    def _layer_metadata(
        self, metadata: Union[AttentionMetadata, list[AttentionMetadata]], state: Optional[StateMetadata] = None
    ) -> Union[AttentionMetadata, list[AttentionMetadata]]:
        """What the model takes: the one metadata of a one-group cache, else one per layer (its
        group's, or a recurrent layer's ``state``)."""
        if self.layer_group_ids is None:
            return metadata[0] if isinstance(metadata, list) else metadata
        if not isinstance(metadata, list):
            raise ValueError(f"{self.num_kv_cache_groups} KV cache groups need one metadata each")
        return [metadata[g] if g >= 0 else state for g in self.layer_group_ids]

    def _state_metadata(self, out: SchedulerOutput, req_ids: list[str], start: np.ndarray, query_start_loc_cpu: list[int]) -> StateMetadata:
        """The recurrent layers' view of the step; a prefix hit's checkpoint is copied into the
        request's live slot first (every layer's state tensors)."""
        steps = [out.state_steps[r] for r in req_ids]
        for step in steps:
            if step.restore_from is not None:
                for tensors in self.state_caches:
                    for t in tensors:
                        t[step.slot].copy_(t[step.restore_from])
        checkpoints = [(i, p - int(start[i]), slot) for i, step in enumerate(steps) for p, slot in step.checkpoints]
        return StateMetadata(
            query_start_loc=torch.tensor(query_start_loc_cpu, dtype=torch.int64),
            slot_ids=torch.tensor([s.slot for s in steps], dtype=torch.int64),
            has_initial_state=torch.from_numpy(start > 0),
            checkpoints=torch.tensor(checkpoints, dtype=torch.int64).reshape(-1, 3),
            query_start_loc_cpu=tuple(query_start_loc_cpu),
        )

    # ---- state updates -----------------------------------------------------------------

    def _update_states(self, out: SchedulerOutput) -> None:
        batch = self.input_batch
        so = self.structured_output
        for req_id in out.finished_req_ids:
            batch.remove_request(req_id)
            if so is not None:
                so.remove_request(req_id)
            if hasattr(self.drafter, "remove_request"):
                self.drafter.remove_request(req_id)
            if self.pooler is not None:
                self.pooler.remove_request(req_id)
            if self.lora_manager is not None:
                self.lora_manager.remove_request(req_id)
        for new in out.new_reqs:
            batch.add_request(
                new.req_id,
                new.token_ids,
                new.num_prompt_tokens,
                new.sampling_params,
                new.block_ids,
                new.num_computed_tokens,
                new.extra_group_block_ids,
                new.pooling_params,
            )
            if self.lora_manager is not None:
                self.lora_manager.add_request(new.req_id, new.lora_request)
            if so is not None and so.wants(new.sampling_params):
                # A resumed request replays the outputs it had, to put its grammar where it was.
                so.add_request(
                    new.req_id, new.sampling_params, new.token_ids[: new.num_prompt_tokens], new.token_ids[new.num_prompt_tokens :]
                )
        for cached in out.cached_reqs:
            row = batch.req_id_to_row[cached.req_id]
            for group_id, block_ids in enumerate(cached.new_block_ids_by_group):
                batch.append_block_ids(row, block_ids, group_id)
            batch.num_computed_tokens[row] = cached.num_computed_tokens

    # ---- one step ----------------------------------------------------------------------

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        offloader = self.offloader
        if offloader is not None:
            # Evicted pages (and a hybrid model's checkpoints) leave the cache before this step's
            # forward pass can overwrite them; loads go to the tier's thread and land beside the steps.
            offloader.save([i for i in out.kv_saves if not is_state_key(i[1])], [i for i in out.kv_saves if is_state_key(i[1])])
            for req_id, items in out.kv_loads.items():
                state = items[0] if items and is_state_key(items[0][1]) else None  # a state loads first
                offloader.load(req_id, items[1:] if state is not None else items, state)
        # A first start's packed-weights file is written between steps, not beside them.
        with pack_cache.stepping():
            result = self._execute_model(out)
        if offloader is not None:
            if out.is_empty:
                offloader.wait(0.005)  # only loads are in flight: give them a moment instead of spinning
            report = offloader.poll()
            result.kv_loads_done, result.kv_tier_removed = report.loaded, report.removed
            result.kv_tier_stats = offloader.stats
        return result

    @torch.inference_mode()
    def _execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        t0 = time.perf_counter()
        self._update_states(out)
        if out.is_empty:
            return ModelRunnerOutput(sampled_token_ids={})
        batch = self.input_batch
        req_ids = list(out.num_scheduled_tokens)
        rows = np.fromiter((batch.req_id_to_row[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        num_sched = np.fromiter(out.num_scheduled_tokens.values(), dtype=np.int64, count=len(req_ids))
        spec = out.scheduled_spec_decode_tokens
        num_drafts = np.zeros(len(req_ids), dtype=np.int64)
        for i, req_id in enumerate(req_ids):
            drafts = spec.get(req_id)
            if drafts:
                # Drafts sit past the row's known tokens, where the gather below reads them.
                row, n = int(rows[i]), int(batch.num_tokens[rows[i]])
                batch.token_ids[row, n : n + len(drafts)] = drafts
                num_drafts[i] = len(drafts)
        start = batch.num_computed_tokens[rows]
        seq_lens = start + num_sched
        cu_end = np.cumsum(num_sched)
        num_tokens = int(cu_end[-1])

        # Flat per-token indices, built without a Python loop over tokens.
        token_seq = np.repeat(np.arange(len(req_ids)), num_sched)
        positions = start[token_seq] + (np.arange(num_tokens) - np.repeat(cu_end - num_sched, num_sched))
        token_rows = rows[token_seq]
        input_ids = batch.token_ids[token_rows, positions]
        block_index, offsets = positions // self.block_size, positions % self.block_size
        max_blocks = int(-(-seq_lens.max() // self.block_size))

        dev = self.device
        query_start_loc = torch.from_numpy(np.concatenate(([0], cu_end)).astype(np.int32)).to(dev)
        seq_lens_dev = torch.from_numpy(seq_lens.astype(np.int32)).to(dev)
        query_start_loc_cpu, seq_lens_cpu = [0] + cu_end.tolist(), seq_lens.tolist()
        # One metadata per KV cache group: the same sequences, each group's own blocks.
        metadata: list[AttentionMetadata] = []
        for table in batch.block_tables:
            slots = table[token_rows, block_index].astype(np.int64) * self.block_size + offsets
            metadata.append(
                AttentionMetadata(
                    query_start_loc=query_start_loc,
                    seq_lens=seq_lens_dev,
                    block_table=torch.from_numpy(np.ascontiguousarray(table[rows, :max_blocks])).to(dev),
                    slot_mapping=torch.from_numpy(slots).to(dev),
                    max_query_len=int(num_sched.max()),
                    max_seq_len=int(seq_lens.max()),
                    query_start_loc_cpu=query_start_loc_cpu,
                    seq_lens_cpu=seq_lens_cpu,
                )
            )
        t1 = time.perf_counter()
        graph_size = self.cuda_graphs.graph_size_for(metadata[0]) if self.cuda_graphs is not None else None
        ids_dev, positions_dev = torch.from_numpy(input_ids).to(dev), torch.from_numpy(positions).to(dev)
        if self.lora_manager is not None:
            self.lora_manager.prepare_step(req_ids, num_sched.tolist())
        state = self._state_metadata(out, req_ids, start, query_start_loc_cpu) if self.state_caches else None
        if graph_size is None:
            hidden = self.model(ids_dev, positions_dev, self.kv_caches, self._layer_metadata(metadata, state))
        else:
            hidden = self.cuda_graphs.run(ids_dev, positions_dev, metadata if len(metadata) > 1 else metadata[0], graph_size)
        t2 = time.perf_counter()
        self.last_timings = {"prepare": t1 - t0, "forward": t2 - t1}

        # Only sequences whose known tokens (and drafts) are now all computed produce tokens.
        sample_mask = seq_lens == batch.num_tokens[rows] + num_drafts
        # max_tokens=0 rows (scoring only, and every pooling request) run their prompt but sample nothing.
        sample_mask &= np.fromiter((batch.params[r].max_tokens != 0 for r in rows.tolist()), dtype=bool, count=len(rows))
        sample_idx = np.nonzero(sample_mask)[0]
        result = ModelRunnerOutput(sampled_token_ids={})
        if self.pooler is not None:
            result.pooler_output = self.pooler.pool(hidden, pooling_chunks(batch, req_ids, rows, start, num_sched, cu_end))
        self._prompt_logprobs(req_ids, rows, start, num_sched, cu_end, hidden, result)
        if len(sample_idx) == 0:
            return result
        sample_rows = rows[sample_idx]
        sample_req_ids = [req_ids[i] for i in sample_idx]
        sample_drafts = [spec.get(r, []) for r in sample_req_ids] if spec else []
        tp = get_tp_group()
        if not any(sample_drafts):
            logits = self.model.compute_logits(hidden[torch.from_numpy(cu_end[sample_idx] - 1).to(dev)])
            if tp.is_first:
                self._sample(logits, sample_rows, sample_req_ids, result)
        else:
            # Requests without drafts sample as usual (the fused kernel); a verifying request's
            # k drafts and the token before them are its last k + 1 positions.
            plain = [i for i, d in enumerate(sample_drafts) if not d]
            verify = [i for i, d in enumerate(sample_drafts) if d]
            ends = cu_end[sample_idx].tolist()
            idx = np.concatenate([np.array([ends[i] - 1 for i in plain], dtype=np.int64)]
                                 + [np.arange(ends[i] - len(sample_drafts[i]) - 1, ends[i]) for i in verify])
            logits = self.model.compute_logits(hidden[torch.from_numpy(idx).to(dev)])
            if tp.is_first:
                if plain:
                    self._sample(logits[: len(plain)], sample_rows[plain], [sample_req_ids[i] for i in plain], result)
                self._verify(
                    logits[len(plain) :],
                    sample_rows[verify],
                    [sample_req_ids[i] for i in verify],
                    [sample_drafts[i] for i in verify],
                    result,
                )
        if tp.world_size > 1:
            self._broadcast_tokens(tp, sample_req_ids, 1 + max((len(d) for d in sample_drafts), default=0), result)
        for req_id, row in zip(sample_req_ids, sample_rows.tolist()):
            for token in result.sampled_token_ids.get(req_id, ()):
                batch.append_token(row, token)
                if self.structured_output is not None:
                    self.structured_output.accept(req_id, token)
        t3 = time.perf_counter()
        self.last_timings["sample"] = t3 - t2
        if self.drafter is not None and out.num_draft_tokens_to_propose:
            self._propose(out.num_draft_tokens_to_propose, sample_req_ids, sample_rows, result)
            self.last_timings["propose"] = time.perf_counter() - t3
            pass_s = getattr(self.drafter, "last_pass_seconds", None)
            if pass_s is not None:
                self.last_timings["propose_pass"] = pass_s
        return result

    def _broadcast_tokens(self, tp, req_ids: list[str], width: int, result: ModelRunnerOutput) -> None:
        """Rank 0 samples; the others take its tokens, so every rank's batch stays the same."""
        tokens = torch.full((len(req_ids), width), -1, dtype=torch.int64, device=self.device)
        if tp.is_first:
            for i, req_id in enumerate(req_ids):
                sampled = result.sampled_token_ids.get(req_id, [])
                tokens[i, : len(sampled)] = torch.tensor(sampled, dtype=torch.int64)
        rows = tp.broadcast(tokens, src=0).tolist()
        if not tp.is_first:
            result.sampled_token_ids = {r: [t for t in row if t >= 0] for r, row in zip(req_ids, rows) if row[0] >= 0}

    def _propose(self, wanted: dict[str, int], req_ids: list[str], rows: np.ndarray, result: ModelRunnerOutput) -> None:
        """Drafts for the next step, for the requests the scheduler asked and that sampled now."""
        batch = self.input_batch
        requests = [(r, row, wanted[r]) for r, row in zip(req_ids, rows.tolist()) if r in wanted and r in result.sampled_token_ids]
        if not requests:
            return
        drafts = self.drafter.propose_batch(batch, requests)
        if self.structured_output is not None:
            drafts = {r: self.structured_output.valid_drafts(r, d) for r, d in drafts.items()}
        result.draft_token_ids = {r: d for r, d in drafts.items() if d}

    def _verify(
        self, logits: torch.Tensor, rows: np.ndarray, req_ids: list[str], drafts: list[list[int]], result: ModelRunnerOutput
    ) -> None:
        try:
            self._verify_rows(logits, rows, req_ids, drafts, result)
            return
        except Exception:  # isolate the failing request below
            logger.exception("batched verification failed; retrying request by request")
        start = 0
        for i, req_id in enumerate(req_ids):
            n = len(drafts[i]) + 1
            try:
                self._verify_rows(logits[start : start + n], rows[i : i + 1], [req_id], drafts[i : i + 1], result)
            except Exception as e:  # noqa: BLE001 - one bad request must not take the batch down
                result.failed[req_id] = f"sampling failed: {type(e).__name__}: {e}"
            start += n

    def _verify_rows(
        self, logits: torch.Tensor, rows: np.ndarray, req_ids: list[str], drafts: list[list[int]], result: ModelRunnerOutput
    ) -> None:
        """Rejection sampling over each request's k + 1 rows, row j set up as if drafts[:j] were sampled."""
        sizes = [len(d) + 1 for d in drafts]
        expanded = np.repeat(rows, sizes)
        prefixes = [d[:j] for d in drafts for j in range(len(d) + 1)]
        metadata = build_sampling_metadata(self.input_batch, expanded, logits.device, self.vocab_size, prefixes)
        if self.structured_output is not None:
            logits = self.structured_output.apply_bitmask_for_drafts(logits, req_ids, drafts)
        draft_probs = getattr(self.drafter, "draft_probs_for", None)
        probs = [draft_probs(r, len(d)) for r, d in zip(req_ids, drafts)] if draft_probs is not None else None
        spec = SpecDecodeMetadata(drafts, probs)
        output = self.rejection_sampler(logits, metadata, spec)
        starts = spec.row_starts
        for i, (req_id, tokens) in enumerate(zip(req_ids, output.output_token_ids)):
            result.sampled_token_ids[req_id] = tokens
            k = self.input_batch.params[int(rows[i])].logprobs
            if k is not None and output.logprobs is not None:
                picked = list(range(starts[i], starts[i] + len(tokens)))
                sub = LogprobsTensors(
                    output.logprobs.token_ids[picked], output.logprobs.logprobs[picked], output.logprobs.ranks[picked]
                )
                result.logprobs[req_id] = _logprob_rows(sub, [k] * len(tokens))

    def _sample(self, logits: torch.Tensor, rows: np.ndarray, req_ids: list[str], result: ModelRunnerOutput) -> None:
        try:
            self._sample_rows(logits, rows, req_ids, result)
            return
        except Exception:  # isolate the failing request below
            logger.exception("batched sampling failed; retrying request by request")
        for i, req_id in enumerate(req_ids):
            try:
                self._sample_rows(logits[i : i + 1], rows[i : i + 1], [req_id], result)
            except Exception as e:  # noqa: BLE001 - one bad request must not take the batch down
                result.failed[req_id] = f"sampling failed: {type(e).__name__}: {e}"

    def _sample_rows(self, logits: torch.Tensor, rows: np.ndarray, req_ids: list[str], result: ModelRunnerOutput) -> None:
        metadata = build_sampling_metadata(self.input_batch, rows, logits.device, self.vocab_size)
        if self.structured_output is not None:
            logits = self.structured_output.apply_bitmask(logits, req_ids)
        output = self.sampler(logits, metadata)
        sampled = output.sampled_token_ids.tolist()
        result.sampled_token_ids.update((r, [t]) for r, t in zip(req_ids, sampled))
        if output.logprobs is not None:
            nums, wanted = [], []
            for i, row in enumerate(rows.tolist()):
                k = self.input_batch.params[row].logprobs
                if k is not None:
                    wanted.append(i)
                    nums.append(k)
            sub = LogprobsTensors(
                output.logprobs.token_ids[wanted], output.logprobs.logprobs[wanted], output.logprobs.ranks[wanted]
            )
            for i, row_lp in zip(wanted, _logprob_rows(sub, nums)):
                result.logprobs[req_ids[i]] = [row_lp]

    def _prompt_logprobs(
        self,
        req_ids: list[str],
        rows: np.ndarray,
        start: np.ndarray,
        num_sched: np.ndarray,
        cu_end: np.ndarray,
        hidden: torch.Tensor,
        result: ModelRunnerOutput,
    ) -> None:
        """Logprobs of each prompt token given what precedes it, for requests that asked."""
        batch = self.input_batch
        for i, (req_id, row) in enumerate(zip(req_ids, rows.tolist())):
            k = batch.params[row].prompt_logprobs
            if k is None:
                continue
            num_prompt = int(batch.num_prompt_tokens[row])
            # Position p predicts token p + 1; only prompt targets count.
            first, last = int(start[i]), min(int(start[i] + num_sched[i]), num_prompt - 1)
            if last <= first:
                continue
            flat_start = int(cu_end[i] - num_sched[i])
            h = hidden[flat_start : flat_start + (last - first)]
            targets = torch.from_numpy(batch.token_ids[row, first + 1 : last + 1].copy()).to(hidden.device)
            tensors = compute_prompt_logprobs(self.model.compute_logits(h), targets, k)
            result.prompt_logprobs[req_id] = _logprob_rows(tensors, [k] * (last - first))
