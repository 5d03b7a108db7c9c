"""Recurrent state slots beside the paged KV cache, and prefix caching that resumes them.

A hybrid model's recurrent layers (Gated DeltaNet, Mamba) keep, per request, a fixed-size state
instead of KV that grows with the context. A slot id indexes every recurrent layer's state tensors,
as a block id indexes every layer of a KV cache group. Each running request holds one live slot,
read and overwritten by every step; it is freed when the request ends or is preempted (a preempted
request is recomputed, as its KV is).

A state summarises the whole prefix, so it cannot be assembled from blocks: a request can resume
only from a state saved exactly where its cached prefix ends. While a request is computed, its
state is therefore checkpointed into spare slots at block boundaries, each checkpoint keyed by the
chained hash of the block that ends there (the same hash as that block's KV):
  * every ``checkpoint_interval`` tokens;
  * at the last full block of the prompt (the next turn of a chat resends it);
  * where this request's prefix-cache hit stopped short of its attention hit: a prefix that an
    earlier request shares up to that point, so the next request with it resumes there.
Checkpoints sit in the slot pool as cached free blocks sit in the block pool: found by hash, evicted
least recently used first when a slot is needed. A checkpoint is written by the step that computes
past its boundary, so it is published only after that step (``finish_step``); until then a request
whose prefix it would serve waits, as it waits for KV blocks another request is computing.

Under speculative decoding a step verifies a token and up to k drafts, and the state must end
after the accepted ones. Each running request then also holds k draft slots; a step with d drafts
saves its state after the token and each of its first d - 1 drafts into them (as checkpoints, at
those offsets), and once the step's acceptance is known (``accept_drafts``) the slot holding the
state after the accepted tokens becomes the live one: a rollback by bookkeeping, no copy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pagellm.core.block_hash import BlockHash
from pagellm.core.block_pool import BlockPool, KVCacheBlock
from pagellm.request import Request


@dataclass(frozen=True)
class StateCacheStats:
    """A snapshot of the slot pool; the two counts of checkpoints are cumulative."""

    num_slots: int
    num_live: int  # slots of running requests (with their draft slots under speculative decoding)
    num_checkpoints: int  # saved states a prefix can resume from
    num_checkpoints_written: int
    num_checkpoints_restored: int


@dataclass(frozen=True)
class StateStep:
    """What the runner does with one request's state in one step."""

    slot: int  # the live state: read (unless the request starts from nothing), then overwritten
    restore_from: Optional[int] = None  # a prefix hit: copy this checkpoint into ``slot`` first
    # (tokens of the request computed when the state is saved, slot it is saved into)
    checkpoints: tuple[tuple[int, int], ...] = ()


class StateCacheManager:
    """The pool of state slots, each request's live slot and the checkpoints prefix caching keeps."""

    def __init__(
        self, num_slots: int, block_size: int, checkpoint_interval: int, enable_caching: bool, num_draft_slots: int = 0
    ) -> None:
        if num_draft_slots < 0:
            raise ValueError(f"num_draft_slots must not be negative, got {num_draft_slots}")
        # Slots one running request holds: its live state and, under speculative decoding, one per draft.
        self.slots_per_request = 1 + num_draft_slots
        if num_slots < self.slots_per_request:
            what = f"one state slot and {num_draft_slots} for its drafts" if num_draft_slots else "one state slot"
            raise ValueError(f"a hybrid model's request needs {what}; the pool has {num_slots} slots")
        if checkpoint_interval < block_size or checkpoint_interval % block_size:
            raise ValueError(f"the state checkpoint interval ({checkpoint_interval}) must be a multiple of the block size ({block_size})")
        self.block_size = block_size
        self.checkpoint_interval = checkpoint_interval
        self.enable_caching = enable_caching
        self.num_draft_slots = num_draft_slots
        self.pool = BlockPool(num_slots, enable_caching)
        self.live: dict[str, KVCacheBlock] = {}
        # Under speculative decoding: where a request's state is saved after the verified token and
        # each draft but the last (the live slot holds the state after all of them).
        self.drafts: dict[str, list[KVCacheBlock]] = {}
        # Where a request's attention hit ended, when its state hit ended earlier (tokens).
        self.attention_hit_tokens: dict[str, int] = {}
        # Checkpoints the step being scheduled writes, with their hashes; published after the step.
        self.pending: list[tuple[KVCacheBlock, BlockHash]] = []
        self.pending_hashes: set[BlockHash] = set()
        # Checkpoints being copied into live slots this step: held so nothing reuses them meanwhile.
        self.restoring: list[KVCacheBlock] = []
        self.steps: dict[str, StateStep] = {}
        # Slots the offloading tier holds during a load: one a state is loaded into, or a
        # checkpoint the loaded pages lead up to (pagellm.core.kv_tier).
        self.tier_held: list[KVCacheBlock] = []
        self.num_checkpoints_written = 0
        self.num_checkpoints_restored = 0

    # ---- prefix-cache lookup ------------------------------------------------------------

    def find_checkpoint(self, block_hashes: list[BlockHash], max_num_blocks: int) -> int:
        """The most leading blocks (at most ``max_num_blocks``) at whose end a state is saved."""
        for num_blocks in range(min(max_num_blocks, len(block_hashes)), 0, -1):
            if self.pool.get_cached_block(block_hashes[num_blocks - 1]) is not None:
                return num_blocks
        return 0

    def note_hit(self, request_id: str, num_attention_hit_blocks: int, num_state_hit_blocks: int) -> None:
        """Remembers a hit that the state cut short: the request checkpoints where its KV hit ended."""
        if num_attention_hit_blocks > num_state_hit_blocks:
            self.attention_hit_tokens[request_id] = num_attention_hit_blocks * self.block_size
        else:
            self.attention_hit_tokens.pop(request_id, None)

    def waits_for_pending(self, request: Request, num_hit_tokens: int) -> bool:
        """Whether a checkpoint this step writes would give ``request`` a longer hit next step."""
        if not self.pending_hashes:
            return False
        end = self.attention_hit_tokens.get(request.request_id, 0) // self.block_size
        first = num_hit_tokens // self.block_size
        return any(h in self.pending_hashes for h in request.block_hashes[first:end])

    # ---- a step -------------------------------------------------------------------------

    def has_live_slot(self, request_id: str) -> bool:
        return request_id in self.live

    def can_admit(self, request: Request, num_hit_blocks: int) -> bool:
        """Whether a live slot (and draft slots) can be had, and the checkpoint a hit restores from
        kept meanwhile (a free one leaves the free queue while it is copied)."""
        restore = self.pool.get_cached_block(request.block_hashes[num_hit_blocks - 1]) if num_hit_blocks else None
        return self.pool.num_free_blocks >= self.slots_per_request + (restore is not None and restore.ref_cnt == 0)

    def allocate(self, request: Request, num_hit_blocks: int, first: int, end: int, num_drafts: int = 0) -> None:
        """Plans ``request``'s state for a step that computes tokens ``[first, end)``: a live slot
        (restored from the checkpoint ending its ``num_hit_blocks``-block hit) when it has none,
        checkpoints at the boundaries the step passes, and with ``num_drafts`` drafts among the
        step's tokens (its last ones) the states to roll back to. The caller checked ``can_admit``."""
        req_id = request.request_id
        if num_drafts > self.num_draft_slots:
            raise ValueError(f"request {req_id}: {num_drafts} drafts, but a request holds {self.num_draft_slots} draft slots")
        restore: Optional[KVCacheBlock] = None
        if req_id not in self.live:
            if num_hit_blocks:
                restore = self.pool.get_cached_block(request.block_hashes[num_hit_blocks - 1])
                if restore is None:
                    raise RuntimeError(f"request {req_id}: the state checkpoint of its prefix hit is gone")
                self.pool.touch([restore])  # before taking a slot, which could evict it
                self.restoring.append(restore)
                self.num_checkpoints_restored += 1
            self.live[req_id] = self.pool.get_new_blocks(1)[0]
            if self.num_draft_slots:
                self.drafts[req_id] = self.pool.get_new_blocks(self.num_draft_slots)
        checkpoints = [c for c in (self._checkpoint(request, p) for p in self._boundaries(request, first, end)) if c is not None]
        # The drafts follow the request's known tokens: the state after those and i drafts, i < num_drafts.
        known = request.num_tokens
        checkpoints += [(known + i, slot.block_id) for i, slot in enumerate(self.drafts.get(req_id, [])[:num_drafts])]
        self.steps[req_id] = StateStep(
            self.live[req_id].block_id,
            restore.block_id if restore is not None else None,
            tuple(sorted(checkpoints)),
        )

    def _boundaries(self, request: Request, first: int, end: int) -> list[int]:
        """Block boundaries in ``(first, end]`` where this request's state is worth keeping."""
        if not self.enable_caching:
            return []
        bs = self.block_size
        wanted = {p for p in range((first // self.checkpoint_interval + 1) * self.checkpoint_interval, end + 1, self.checkpoint_interval)}
        wanted.add(request.num_prompt_tokens // bs * bs)
        wanted.add(self.attention_hit_tokens.get(request.request_id, 0))
        return sorted(p for p in wanted if first < p <= end and 0 < p and p // bs <= len(request.block_hashes))

    def _checkpoint(self, request: Request, num_tokens: int) -> Optional[tuple[int, int]]:
        block_hash = request.block_hashes[num_tokens // self.block_size - 1]
        if block_hash in self.pending_hashes or self.pool.get_cached_block(block_hash) is not None:
            return None  # saved already, or being saved by another request this step
        if self.pool.num_free_blocks <= self.slots_per_request:
            return None  # keep slots for the next request to start: a checkpoint is only a saving
        slot = self.pool.get_new_blocks(1)[0]
        self.pending.append((slot, block_hash))
        self.pending_hashes.add(block_hash)
        return num_tokens, slot.block_id

    def accept_drafts(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """After a step that verified ``num_drafts`` drafts of which ``num_accepted`` held: the
        draft slot with the state after them becomes the live one (the live slot, holding the
        state after every draft, takes its place among the draft slots)."""
        if num_accepted >= num_drafts or request_id not in self.live:
            return
        drafts = self.drafts[request_id]
        drafts[num_accepted], self.live[request_id] = self.live[request_id], drafts[num_accepted]

    def take_steps(self) -> dict[str, StateStep]:
        steps, self.steps = self.steps, {}
        return steps

    def finish_step(self) -> None:
        """After the step ran: its checkpoints are written, so they are published (free, findable),
        and the checkpoints it copied from are released."""
        for slot, block_hash in self.pending:
            self.pool.cache_full_blocks([slot], [block_hash], 0, 1)
        self.pool.free_blocks(slot for slot, _ in self.pending)
        self.num_checkpoints_written += len(self.pending)
        self.pool.free_blocks(self.restoring)
        self.pending, self.pending_hashes, self.restoring = [], set(), []

    def free(self, request_id: str) -> None:
        slot = self.live.pop(request_id, None)
        self.attention_hit_tokens.pop(request_id, None)
        self.steps.pop(request_id, None)
        if slot is not None:
            self.pool.free_blocks([slot, *self.drafts.pop(request_id, [])])

    # ---- the offloading tier (pagellm.core.kv_tier) -------------------------------------

    def enable_tier(self) -> None:
        """Checkpoints handed out again are recorded (``take_evictions``), to be saved first."""
        self.pool.evictions = []

    def take_evictions(self) -> list[tuple[int, BlockHash]]:
        """(slot, block hash) of each checkpoint handed out again since the last call."""
        evicted = self.pool.evictions or []
        self.pool.evictions = [] if self.pool.evictions is not None else None
        return evicted

    def hold_for_tier(self, block_hash: BlockHash) -> Optional[KVCacheBlock]:
        """The checkpoint saved at ``block_hash``, held while pages leading to it load; None when
        there is none or holding it would take the last free slot (a live slot's)."""
        slot = self.pool.get_cached_block(block_hash)
        if slot is None or (slot.ref_cnt == 0 and self.pool.num_free_blocks <= self.slots_per_request):
            return None
        self.pool.touch([slot])
        self.tier_held.append(slot)
        return slot

    def slot_for_tier(self) -> Optional[KVCacheBlock]:
        """A free slot for a state loaded from the tier (evicting the least recently used
        checkpoint); None when it would take the slots a request needs to start."""
        if self.pool.num_free_blocks <= self.slots_per_request:
            return None
        slot = self.pool.get_new_blocks(1)[0]
        self.tier_held.append(slot)
        return slot

    def release_tier_slot(self, slot: KVCacheBlock, block_hash: Optional[BlockHash] = None) -> None:
        """Gives back a slot ``hold_for_tier`` or ``slot_for_tier`` gave; a state loaded under
        ``block_hash`` stays as a checkpoint (free and findable)."""
        self.tier_held.remove(slot)
        if block_hash is not None:
            self.pool.cache_loaded_block(slot, block_hash)
        self.pool.free_blocks([slot])

    # ---- reading ------------------------------------------------------------------------

    @property
    def num_slots(self) -> int:
        return self.pool.num_blocks

    @property
    def num_checkpoints(self) -> int:
        """Saved states a prefix can resume from (free and findable)."""
        return self.pool.num_cached_free_blocks

    def stats(self) -> StateCacheStats:
        return StateCacheStats(
            self.num_slots,
            len(self.live) * self.slots_per_request,
            self.num_checkpoints,
            self.num_checkpoints_written,
            self.num_checkpoints_restored,
        )

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache() if not self.live else False

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        drafts = [b for slots in self.drafts.values() for b in slots]
        held = len({b.block_id for b in [*self.live.values(), *drafts, *(s for s, _ in self.pending), *self.restoring, *self.tier_held]})
        if held != self.pool.num_used_blocks:
            raise RuntimeError(f"state slots: {self.pool.num_used_blocks} in use, {held} accounted for")
