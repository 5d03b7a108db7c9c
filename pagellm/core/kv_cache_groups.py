"""KV cache groups: which layers share a page of the block pool, as vLLM's hybrid allocator forms them.

Layers are grouped by attention kind (full attention, or a sliding window of W tokens). Every
group has the same number of layers, ``group_size``, so one block id is one page that holds
``group_size`` layers' keys and values for ``block_size`` tokens, owned by one group of one
request. Position k of every group uses the same KV tensor ``[2, num_blocks, block_size, heads,
row]``. A full-attention group keeps a request's whole context; a sliding group only the blocks
its window still reaches, so a Gemma 3-shape request holds about a sixth of a full model's KV.

A model whose layers are all full attention is one group of all its layers: one tensor per
layer and one block table per request, exactly the layout before groups existed.

A hybrid model's recurrent layers (Gated DeltaNet, Mamba) hold no KV: they are the layout's
state kind, a fixed-size slot per request in each (pagellm.core.state_cache), and the attention
groups cover the other layers. Two more kinds of layer own no blocks: a block that is only an MLP
(Nemotron-H's) holds nothing, and a layer that attends over an earlier layer's KV (Gemma 4's last
layers) reads that layer's tensor and block table, as vLLM's KV sharing does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

# vLLM's threshold: when the largest kind has fewer than 1.25 times the layers of the smallest,
# pad every kind up to the largest instead of splitting it (12 sliding + 13 full: 2 groups of 13).
_PAD_TO_LARGEST_RATIO = 1.25


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def kv_owning_layers(
    num_layers: int, state_layer_ids: Sequence[int], no_cache_layer_ids: Sequence[int], kv_shared_layers: Sequence[tuple[int, int]]
) -> tuple[int, ...]:
    """The layers that hold KV of their own: not recurrent, not cacheless, not reading another's."""
    other = set(state_layer_ids) | set(no_cache_layer_ids) | {layer for layer, _ in kv_shared_layers}
    return tuple(i for i in range(num_layers) if i not in other)


def check_layer_roles(
    num_layers: int,
    windows: Sequence[Optional[int]],
    state_layer_ids: Sequence[int],
    no_cache_layer_ids: Sequence[int],
    kv_shared_layers: Sequence[tuple[int, int]],
) -> None:
    """Each layer has one role (KV of its own, recurrent state, no cache, or another layer's KV),
    at least one holds KV, and a shared layer's source holds KV over the same window."""
    shared = [layer for layer, _ in kv_shared_layers]
    roles = list(state_layer_ids) + list(no_cache_layer_ids) + shared
    if len(set(roles)) != len(roles) or any(not 0 <= i < num_layers for i in roles):
        raise ValueError(f"layers with two roles or out of range among {num_layers}: recurrent {list(state_layer_ids)}, "
                         f"no cache {list(no_cache_layer_ids)}, reading another's KV {shared}")
    owners = kv_owning_layers(num_layers, state_layer_ids, no_cache_layer_ids, kv_shared_layers)
    if not owners:
        raise ValueError("a model needs at least one attention layer that holds KV")
    for layer, source in kv_shared_layers:
        if source not in owners or windows[layer] != windows[source]:
            raise ValueError(f"layer {layer} reads the KV of layer {source}, which holds none of its own or attends over another window")


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """One group: its layers (position k uses KV tensor k) and the window they attend over."""

    layer_ids: tuple[int, ...]
    sliding_window: Optional[int] = None  # None: full attention

    @property
    def is_sliding(self) -> bool:
        return self.sliding_window is not None

    def describe(self) -> str:
        kind = f"sliding window {self.sliding_window}" if self.is_sliding else "full attention"
        return f"{kind}: layers {list(self.layer_ids)}"


@dataclass(frozen=True)
class KVCacheLayout:
    """How a model's layers map onto the block pool: the groups and the tensors they share."""

    groups: tuple[KVCacheGroupSpec, ...]
    group_size: int  # KV tensors in the pool: layers per group, padding included
    num_layers: int
    # Recurrent layers: a state slot per request each, no KV blocks (the state kind).
    state_layer_ids: tuple[int, ...] = ()
    # Layers that own no blocks: no cache at all, or (layer, source) reading the source's KV.
    no_cache_layer_ids: tuple[int, ...] = ()
    kv_shared_layers: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError("a KV cache layout needs at least one group")
        seen = sorted(layer for g in self.groups for layer in g.layer_ids)
        attention = list(kv_owning_layers(self.num_layers, self.state_layer_ids, self.no_cache_layer_ids, self.kv_shared_layers))
        if seen != attention:
            raise ValueError(f"the groups must cover the attention layers {attention} once each, got {seen}")
        if any(len(g.layer_ids) > self.group_size for g in self.groups):
            raise ValueError(f"a group holds more than group_size={self.group_size} layers")
        if any(g.sliding_window is not None and g.sliding_window < 1 for g in self.groups):
            raise ValueError("a sliding window must be at least one token")

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def plain(self) -> bool:
        """One full-attention group of every layer: the layout of a cache without groups."""
        return self.num_groups == 1 and not self.has_sliding_groups and not self.has_state and not self.has_layers_without_blocks

    @property
    def has_layers_without_blocks(self) -> bool:
        """Some non-recurrent layer owns no blocks (an MLP-only block, or one reading another's KV)."""
        return bool(self.no_cache_layer_ids or self.kv_shared_layers)

    @property
    def has_state(self) -> bool:
        return bool(self.state_layer_ids)

    @property
    def has_sliding_groups(self) -> bool:
        return any(g.is_sliding for g in self.groups)

    @property
    def group_windows(self) -> tuple[Optional[int], ...]:
        return tuple(g.sliding_window for g in self.groups)

    @property
    def layer_group_ids(self) -> tuple[int, ...]:
        """Per layer, the group whose block table and slot mapping it reads (-1: a recurrent layer
        or one without a cache; a layer reading another's KV: that layer's group)."""
        out = [-1] * self.num_layers
        for group_id, group in enumerate(self.groups):
            for layer in group.layer_ids:
                out[layer] = group_id
        for layer, source in self.kv_shared_layers:
            out[layer] = out[source]
        return tuple(out)

    @property
    def layer_tensor_ids(self) -> tuple[int, ...]:
        """Per layer, which of the ``group_size`` KV tensors holds its keys and values (a recurrent
        layer: which of the state layers' tensors holds its state)."""
        out = [0] * self.num_layers
        for group in self.groups:
            for position, layer in enumerate(group.layer_ids):
                out[layer] = position
        for position, layer in enumerate(self.state_layer_ids):
            out[layer] = position
        for layer, source in self.kv_shared_layers:
            out[layer] = out[source]
        return tuple(out)

    @property
    def num_reserved_blocks(self) -> int:
        """Blocks of the pool no request can own: the null block that skipped entries point to."""
        return 1 if self.has_sliding_groups else 0

    def max_blocks_per_request(self, num_tokens: int, block_size: int, max_chunk_tokens: int) -> int:
        """The most blocks one request of ``num_tokens`` holds at once, all groups together, when a
        step computes at most ``max_chunk_tokens`` of it: a sliding group keeps what the step's
        first query still reaches (W - 1 tokens back) plus the chunk."""
        full = cdiv(num_tokens, block_size)
        total = 0
        for group in self.groups:
            if group.sliding_window is None:
                total += full
            else:
                total += min(full, cdiv(group.sliding_window - 1 + max_chunk_tokens, block_size) + 1)
        return total

    def max_tokens_that_fit(self, num_blocks: int, block_size: int, max_chunk_tokens: int, limit: int) -> int:
        """The longest request (up to ``limit`` tokens) one pool of ``num_blocks`` can hold alone."""
        usable = num_blocks - self.num_reserved_blocks
        lo, hi = 0, limit
        while lo < hi:  # the need grows with the length: bisect for the last length that fits
            mid = (lo + hi + 1) // 2
            if self.max_blocks_per_request(mid, block_size, max_chunk_tokens) <= usable:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def describe(self) -> str:
        if self.plain:
            return f"1 group of {self.num_layers} full-attention layers"
        kinds: dict[Optional[int], int] = {}
        for g in self.groups:
            kinds[g.sliding_window] = kinds.get(g.sliding_window, 0) + 1
        parts = [f"{n} {'full' if w is None else f'sliding W={w}'}" for w, n in kinds.items()]
        groups = f"{self.num_groups} group{'s' if self.num_groups > 1 else ''}"
        state = f" and {len(self.state_layer_ids)} recurrent layers (a state slot per request)" if self.has_state else ""
        if self.kv_shared_layers:
            state += f", {len(self.kv_shared_layers)} layers reading an earlier layer's KV"
        if self.no_cache_layer_ids:
            state += f", {len(self.no_cache_layer_ids)} layers without a cache"
        return f"{groups} of {self.group_size} layer{'s' if self.group_size > 1 else ''} ({', '.join(parts)}){state}"


def single_group_layout(num_layers: int) -> KVCacheLayout:
    """Every layer in one full-attention group (also how a manager that keeps whole contexts sees
    a sliding-window model: the backends still apply the window, only nothing is freed)."""
    if num_layers < 1:
        raise ValueError(f"a model needs at least one layer, got {num_layers}")
    return KVCacheLayout((KVCacheGroupSpec(tuple(range(num_layers))),), num_layers, num_layers)


def group_layers(
    layer_sliding_windows: Sequence[Optional[int]],
    state_layer_ids: Sequence[int] = (),
    no_cache_layer_ids: Sequence[int] = (),
    kv_shared_layers: Sequence[tuple[int, int]] = (),
) -> KVCacheLayout:
    """Groups layers by attention kind, vLLM's way (over the layers that hold KV of their own).

    Full attention comes first (group 0, the one whose table covers the whole context), then each
    window in the order its first layer appears. The group size is the smallest count of any kind
    (or the largest, when no kind has 1.25 times the layers of another); a kind with more layers
    is split into ``cdiv(count, group_size)`` groups, group i taking its layers i, i + n, i + 2n,
    ... so that any padding is spread over the last groups rather than a nearly empty one.
    """
    windows = list(layer_sliding_windows)
    if not windows:
        raise ValueError("a model needs at least one layer")
    for w in windows:
        if w is not None and (not isinstance(w, int) or w < 1):
            raise ValueError(f"a sliding window must be a positive number of tokens, got {w!r}")
    state = tuple(sorted(state_layer_ids))
    no_cache, shared = tuple(sorted(no_cache_layer_ids)), tuple(sorted((int(a), int(b)) for a, b in kv_shared_layers))
    check_layer_roles(len(windows), windows, state, no_cache, shared)
    roles = dict(state_layer_ids=state, no_cache_layer_ids=no_cache, kv_shared_layers=shared)
    owners = kv_owning_layers(len(windows), state, no_cache, shared)
    kinds: dict[Optional[int], list[int]] = {}
    if any(windows[i] is None for i in owners):
        kinds[None] = []
    for layer in owners:
        kinds.setdefault(windows[layer], []).append(layer)
    if len(kinds) == 1 and None in kinds:
        if not (state or no_cache or shared):
            return single_group_layout(len(windows))
        layers = tuple(kinds[None])
        return KVCacheLayout((KVCacheGroupSpec(layers),), len(layers), len(windows), **roles)
    counts = [len(layers) for layers in kinds.values()]
    group_size = min(counts)
    if max(counts) < min(counts) * _PAD_TO_LARGEST_RATIO:
        group_size = max(counts)
    groups: list[KVCacheGroupSpec] = []
    for window, layers in kinds.items():
        num_groups = cdiv(len(layers), group_size)
        groups.extend(KVCacheGroupSpec(tuple(layers[i::num_groups]), window) for i in range(num_groups))
    return KVCacheLayout(tuple(groups), group_size, len(windows), **roles)
