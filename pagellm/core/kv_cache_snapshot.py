"""A snapshot of the paged KV cache and the scheduler's queues, kept up to date by diffs.

The dashboard (``pagellm.entrypoints.dashboard``) and ``pagellm bench compare
--block-map-png`` read the engine's cache and queues (``LLMEngine.kv_cache_view``) only through
this module. ``KVCacheSnapshotter`` keeps a mirror
of every block's state as one byte; ``poll()`` brings it up to date from the block ids the pool
marked dirty since the last poll (``BlockPool.take_dirty_block_ids``), so a poll costs
O(changed blocks + requests), never a scan of the pool. Like the scheduler, it never touches
tensors, and it must run on the thread that steps the engine (``AsyncLLM.run_in_engine``).

A block's state byte (``block_code``): 0 free, 1 cached (free but still findable by its prefix
hash, so in the LRU), ``n + 1`` when ``n`` requests hold it (2: one owner, 3 and up: shared),
capped at 255.

With several KV cache groups (a hybrid sliding-window model) ``tables`` are group 0's (the
full-attention one where there is one) and ``group_tables`` hold the others', keyed by group id,
with ``groups`` saying what each group is (its window and layers); a block's owners are looked up
in every group. Entries a window has left behind point to the pool's null block (id 0), which
shows as free.

A hybrid model's recurrent state slots (``kv_cache_manager.state_cache``, a second ``BlockPool``)
are mirrored the same way, from that pool's own dirty ids, under the snapshot's ``state`` key (absent
for a model without recurrent layers). A slot's state byte (``slot_code``): 0 free, 1 checkpoint (a
saved state, findable by the hash of the block it ends at, evictable), 2 live (a running request's
state), 3 saving (held, but no request's live slot: a checkpoint the scheduled step is writing;
never seen between steps). ``state.owners`` maps each running request to its live slot.

Privacy: token text appears only when a ``decode`` function is given (``--dashboard-show-text``).
Without one, the snapshot holds token counts, block ids and hash prefixes, never token ids or text.
"""
from __future__ import annotations

import base64
from typing import Any, Callable, Optional

from pagellm.core.block_pool import KVCacheBlock
from pagellm.core.kv_cache_base import KVCacheManagerBase
from pagellm.core.scheduler import Scheduler
from pagellm.request import Request

FREE, CACHED = 0, 1
STATE_NAMES = ("free", "cached", "used", "shared")  # the legend's four states
TEXT_PREVIEW_TOKENS = 48  # prompt tokens shown per request with --dashboard-show-text
HASH_PREFIX_BYTES = 6


SLOT_FREE, SLOT_CHECKPOINT, SLOT_LIVE, SLOT_SAVING = 0, 1, 2, 3
SLOT_STATE_NAMES = ("free", "checkpoint", "live", "saving")  # indexed by slot_code


def slot_code(slot: KVCacheBlock, owned: bool) -> int:
    """A state slot's state byte; ``owned``: it is a running request's live slot."""
    if slot.block_hash is not None:
        return SLOT_CHECKPOINT  # free and findable, or held for a step while a restore copies it
    if slot.ref_cnt == 0:
        return SLOT_FREE
    return SLOT_LIVE if owned else SLOT_SAVING


def block_code(block: KVCacheBlock) -> int:
    if block.ref_cnt > 0:
        return min(block.ref_cnt + 1, 255)
    return CACHED if block.block_hash is not None else FREE


def state_index(code: int) -> int:
    """Index into ``STATE_NAMES`` of a state byte."""
    return code if code < 2 else (2 if code == 2 else 3)


def _status_name(request: Request) -> str:
    name = getattr(request.status, "name", str(request.status)).lower()
    return name


class KVCacheSnapshotter:
    """Mirrors a KV cache manager's blocks and a scheduler's queues; hands out full states and diffs."""

    def __init__(
        self,
        kv_cache_manager: KVCacheManagerBase,
        scheduler: Scheduler,
        decode: Optional[Callable[[list[int]], str]] = None,
        cache_info: Optional[dict[str, Any]] = None,
    ) -> None:
        self.kv_cache_manager = kv_cache_manager
        # What the blocks hold, for the header: element type, bytes, tokens (the engine's memory plan).
        self.cache_info = dict(cache_info or {})
        self.scheduler = scheduler
        self.decode = decode
        self.block_size: int = kv_cache_manager.block_size
        pool = kv_cache_manager.block_pool
        pool.take_dirty_block_ids()  # the scan below reads everything, so earlier changes are in it
        self.codes = bytearray(block_code(b) for b in pool.blocks)
        self.state_counts = [0, 0, 0, 0]
        for code in self.codes:
            self.state_counts[state_index(code)] += 1
        self.version = 0
        # Block tables as last sent, per group: request id -> (the engine's list object, its length
        # then, its leading null entries then). Holding the list keeps its id from being reused.
        self._group_tables: list[dict[str, tuple[list, int, int]]] = [{} for _ in kv_cache_manager.group_tables]
        self._requests: list[dict[str, Any]] = []
        self._request_keys: list[tuple] = []
        self._text_cache: dict[str, str] = {}
        # A hybrid model's state slots: one byte per slot, each request's live slot as last sent
        # (the engine's slot object, held so its identity means what it meant), the slot -> owner map.
        self.state_cache = getattr(kv_cache_manager, "state_cache", None)
        if self.state_cache is not None:
            state = self.state_cache
            state.pool.take_dirty_block_ids()  # the scan below reads everything
            self._live_sent: dict[str, KVCacheBlock] = dict(state.live)
            self._slot_owner: dict[int, str] = {slot.block_id: req_id for req_id, slot in state.live.items()}
            self.slot_codes = bytearray(slot_code(b, b.block_id in self._slot_owner) for b in state.pool.blocks)
            self.slot_counts = [0, 0, 0, 0]
            for code in self.slot_codes:
                self.slot_counts[code] += 1
            info = self.cache_info
            self.slot_bytes: Optional[int] = (
                info["state_bytes"] // info["state_slots"] if info.get("state_slots") and "state_bytes" in info else None
            )
            self._sent_slot_counts = self.slot_state_counts()

    @property
    def num_blocks(self) -> int:
        return len(self.codes)

    # -- polling -------------------------------------------------------------------------------------

    def poll(self) -> Optional[dict[str, Any]]:
        """Brings the mirror up to date; returns what changed since the last poll, or None."""
        diff: dict[str, Any] = {}
        blocks = self._poll_blocks()
        if blocks:
            diff["blocks"] = blocks
        group_tables = self.kv_cache_manager.group_tables
        for group_id, (engine_tables, sent) in enumerate(zip(group_tables, self._group_tables)):
            tables, removed = self._poll_tables(engine_tables, sent)
            if group_id == 0:
                if tables:
                    diff["tables"] = tables
                if removed:
                    diff["tables_removed"] = removed
            else:
                if tables:
                    diff.setdefault("group_tables", {})[str(group_id)] = tables
                if removed:
                    diff.setdefault("group_tables_removed", {})[str(group_id)] = removed
        if self._poll_requests():
            diff["requests"] = self._requests
        if self.state_cache is not None:
            state = self._poll_state()
            if state:
                diff["state"] = state
        if not diff:
            return None
        self.version += 1
        diff["type"] = "diff"
        diff["v"] = self.version
        diff["counts"] = self.counts()
        return diff

    def _poll_blocks(self) -> list[list[int]]:
        pool = self.kv_cache_manager.block_pool
        dirty = pool.take_dirty_block_ids()
        if not dirty:
            return []
        all_blocks, codes, counts = pool.blocks, self.codes, self.state_counts
        changes = []
        for block_id in sorted(dirty):
            code = block_code(all_blocks[block_id])
            old = codes[block_id]
            if code != old:
                codes[block_id] = code
                counts[state_index(old)] -= 1
                counts[state_index(code)] += 1
                changes.append([block_id, code])
        return changes

    def _poll_state(self) -> dict[str, Any]:
        """The state slots' changes: ``slots`` ``[[id, code], ...]``, ``owners`` (request -> its
        new live slot), ``owners_removed``, and ``counts`` whenever anything changed."""
        state = self.state_cache
        pool = state.pool
        dirty = pool.take_dirty_block_ids()
        owners: dict[str, int] = {}
        sent, owner_of = self._live_sent, self._slot_owner
        for req_id, slot in state.live.items():
            old = sent.get(req_id)
            if old is slot:
                continue
            if old is not None:
                dirty.add(old.block_id)
                if owner_of.get(old.block_id) == req_id:
                    del owner_of[old.block_id]
            sent[req_id] = slot
            owner_of[slot.block_id] = req_id
            owners[req_id] = slot.block_id
            dirty.add(slot.block_id)
        removed = [req_id for req_id in sent if req_id not in state.live]
        for req_id in removed:
            old = sent.pop(req_id)
            dirty.add(old.block_id)
            if owner_of.get(old.block_id) == req_id:
                del owner_of[old.block_id]
        changes = []
        if dirty:
            blocks, codes, counts = pool.blocks, self.slot_codes, self.slot_counts
            for slot_id in sorted(dirty):
                code = slot_code(blocks[slot_id], slot_id in owner_of)
                old_code = codes[slot_id]
                if code != old_code:
                    codes[slot_id] = code
                    counts[old_code] -= 1
                    counts[code] += 1
                    changes.append([slot_id, code])
        # The engine's counters can move with no slot changing state (a checkpoint held for a
        # restore and released, a resume counted): they are sent whenever they differ.
        slot_counts = self.slot_state_counts()
        if not (changes or owners or removed or slot_counts != self._sent_slot_counts):
            return {}
        self._sent_slot_counts = slot_counts
        out: dict[str, Any] = {}
        if changes:
            out["slots"] = changes
        if owners:
            out["owners"] = owners
        if removed:
            out["owners_removed"] = removed
        out["counts"] = slot_counts
        return out

    def _poll_tables(
        self, req_to_blocks: dict[str, list], sent: dict[str, tuple[list, int, int]]
    ) -> tuple[dict[str, list[int]], list[str]]:
        """One group's changes: per request ``[start, id, id, ...]`` (its table from ``start`` on is
        those ids), and the requests whose tables are gone."""
        null = self.kv_cache_manager.block_pool.null_block
        changed: dict[str, list[int]] = {}
        for req_id, blocks in req_to_blocks.items():
            prev = sent.get(req_id)
            n = len(blocks)
            same = prev is not None and prev[0] is blocks
            # A sliding window nulls entries from the front, never elsewhere: follow the run's end.
            num_null = prev[2] if same else 0
            while null is not None and num_null < n and blocks[num_null] is null:
                num_null += 1
            if same and prev[1] == n and prev[2] == num_null:
                continue
            # Tables only grow while a request runs; a freed and reallocated one is a new list.
            start = 0
            if same and prev[1] <= n:
                start = prev[2] if num_null != prev[2] else prev[1]
            changed[req_id] = [start, *(b.block_id for b in blocks[start:])]
            sent[req_id] = (blocks, n, num_null)
        removed = [req_id for req_id in sent if req_id not in req_to_blocks]
        for req_id in removed:
            del sent[req_id]
        return changed, removed

    def _poll_requests(self) -> bool:
        sched = self.scheduler
        queue = [*sched.running, *sched.waiting]
        keys = [
            (r.request_id, r.status, r.num_prompt_tokens, r.num_output_tokens, r.num_computed_tokens, r.num_preemptions)
            for r in queue
        ]
        if keys == self._request_keys:
            return False
        self._request_keys = keys
        num_running = len(sched.running)
        self._requests = [self._describe_request(r, i < num_running) for i, r in enumerate(queue)]
        live = {r.request_id for r in queue}
        for req_id in [k for k in self._text_cache if k not in live]:
            del self._text_cache[req_id]
        return True

    def _describe_request(self, r: Request, running: bool) -> dict[str, Any]:
        out = {
            "id": r.request_id,
            "queue": "running" if running else "waiting",
            "status": _status_name(r),
            "prompt": r.num_prompt_tokens,
            "output": r.num_output_tokens,
            "computed": r.num_computed_tokens,
            "preemptions": r.num_preemptions,
        }
        if self.decode is not None:
            text = self._text_cache.get(r.request_id)
            if text is None:
                text = self._text_cache[r.request_id] = self.decode(
                    list(r.all_token_ids[: min(r.num_prompt_tokens, TEXT_PREVIEW_TOKENS)])
                )
            out["text"] = text
        return out

    # -- full state ------------------------------------------------------------------------------------

    def counts(self) -> dict[str, int]:
        """Blocks per state in the mirror, and the pool's own counters beside them."""
        pool = self.kv_cache_manager.block_pool
        out = dict(zip(STATE_NAMES, self.state_counts))
        out["engine_free"] = pool.num_free_blocks
        out["engine_used"] = pool.num_used_blocks
        return out

    def slot_state_counts(self) -> dict[str, Any]:
        """Slots per state in the mirror, the slot pool's own counters, the cumulative checkpoints
        saved and resumed from, and bytes (per rank; None where the memory plan is not known)."""
        state = self.state_cache
        out: dict[str, Any] = dict(zip(SLOT_STATE_NAMES, self.slot_counts))
        out["engine_live"] = len(state.live)
        out["engine_checkpoints"] = state.num_checkpoints
        out["engine_free"] = state.pool.num_free_blocks  # checkpoints included: they give way to new requests
        out["written"] = state.num_checkpoints_written
        out["restored"] = state.num_checkpoints_restored
        out["slot_bytes"] = self.slot_bytes
        out["checkpoint_bytes"] = self.slot_bytes * self.slot_counts[SLOT_CHECKPOINT] if self.slot_bytes is not None else None
        return out

    def full(self) -> dict[str, Any]:
        """The whole mirrored state (call ``poll()`` first for an up-to-date one)."""
        def as_ids(sent: dict[str, tuple[list, int, int]]) -> dict[str, list[int]]:
            return {req_id: [b.block_id for b in blocks[:n]] for req_id, (blocks, n, _) in sent.items()}

        state = {
            "type": "full",
            "v": self.version,
            "num_blocks": len(self.codes),
            "block_size": self.block_size,
            "show_text": self.decode is not None,
            "cache": self.cache_info,
            "codes": base64.b64encode(bytes(self.codes)).decode("ascii"),
            "tables": as_ids(self._group_tables[0]),
            "requests": self._requests,
            "counts": self.counts(),
        }
        if len(self._group_tables) > 1:
            state["groups"] = self._describe_groups()
            state["group_tables"] = {str(g): as_ids(sent) for g, sent in enumerate(self._group_tables) if g > 0}
        if self.state_cache is not None:
            state["state"] = {
                "num_slots": len(self.slot_codes),
                "checkpoint_interval": self.state_cache.checkpoint_interval,
                "codes": base64.b64encode(bytes(self.slot_codes)).decode("ascii"),
                "owners": {req_id: slot.block_id for req_id, slot in self._live_sent.items()},
                "counts": self.slot_state_counts(),
            }
        return state

    def _describe_groups(self) -> list[dict[str, Any]]:
        """Each KV cache group's window (None: full attention) and layers, for the dashboard's labels."""
        layout = getattr(self.kv_cache_manager, "kv_cache_layout", None)
        if layout is None:
            return [{"window": None, "layers": []} for _ in self._group_tables]
        return [{"window": g.sliding_window, "layers": list(g.layer_ids)} for g in layout.groups]

    # -- one block or state slot, on demand (hover) ---------------------------------------------------

    def describe_slot(self, slot_id: int) -> dict[str, Any]:
        """A state slot's live state: its owner (a live slot), or for a checkpoint the hash prefix of
        the block it ends at and that block's id while the KV pool still caches it."""
        if self.state_cache is None:
            raise ValueError("this model has no recurrent state slots")
        state = self.state_cache
        blocks = state.pool.blocks
        if not 0 <= slot_id < len(blocks):
            raise ValueError(f"slot id {slot_id} is out of range (0..{len(blocks) - 1})")
        slot = blocks[slot_id]
        owner = next((req_id for req_id, s in state.live.items() if s is slot), None)
        out: dict[str, Any] = {
            "id": slot_id,
            "state": SLOT_STATE_NAMES[slot_code(slot, owner is not None)],
            "ref_cnt": slot.ref_cnt,
            "owner": owner,
            "hash": slot.block_hash.hex()[: 2 * HASH_PREFIX_BYTES] if slot.block_hash is not None else None,
            "kv_block": None,
        }
        if slot.block_hash is not None:
            kv_block = self.kv_cache_manager.block_pool.get_cached_block(slot.block_hash)
            out["kv_block"] = kv_block.block_id if kv_block is not None else None
        return out

    def describe_block(self, block_id: int) -> dict[str, Any]:
        """A block's live state: owners, the tokens it holds (as text only with ``decode``), hash prefix."""
        pool = self.kv_cache_manager.block_pool
        if not 0 <= block_id < len(pool.blocks):
            raise ValueError(f"block id {block_id} is out of range (0..{len(pool.blocks) - 1})")
        block = pool.blocks[block_id]
        code = block_code(block)
        out: dict[str, Any] = {
            "id": block_id,
            "state": STATE_NAMES[state_index(code)],
            "ref_cnt": block.ref_cnt,
            "hash": block.block_hash.hex()[: 2 * HASH_PREFIX_BYTES] if block.block_hash is not None else None,
            "owners": [],
        }
        requests = {r.request_id: r for r in (*self.scheduler.running, *self.scheduler.waiting)}
        group_tables = self.kv_cache_manager.group_tables
        if block is not pool.null_block:
            for group_id, tables in enumerate(group_tables):
                for req_id, blocks in tables.items():
                    for index, b in enumerate(blocks):
                        if b is block:
                            owner = {"id": req_id, "index": index}
                            if len(group_tables) > 1:
                                owner["group"] = group_id
                            out["owners"].append(owner)
        if out["owners"]:
            owner = out["owners"][0]
            request = requests.get(owner["id"])
            if request is not None:
                start = owner["index"] * self.block_size
                tokens = request.all_token_ids[start : start + self.block_size]
                out["num_tokens"] = len(tokens)
                out["num_written"] = max(0, min(self.block_size, request.num_computed_tokens - start))
                if self.decode is not None:
                    out["text"] = self.decode(list(tokens))
        return out
