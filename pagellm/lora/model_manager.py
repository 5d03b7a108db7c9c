"""The engine's adapters: a fixed pool of ``max_loras`` slots in every adapted layer (LRU-evicted),
a cache of up to ``max_cpu_loras`` adapters loaded from disk, and each running request's adapter.

The model runner tells it which requests entered and left the batch and, once per step, the flat
batch's layout; it then makes sure the step's adapters sit in slots and publishes the segments
every layer reads (:class:`~pagellm.lora.layers.LoRAStepContext`).
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any, Callable, Optional, Protocol

import torch

from pagellm.lora.layers import LoRABatch, LoRALayerWeights, LoRAStepContext
from pagellm.lora.peft_adapter import PEFTAdapter, load_peft_adapter
from pagellm.lora.request import LoRARequest

logger = logging.getLogger(__name__)

# The fused layers an adapter's modules land in (their shards: q/k/v, gate/up).
ADAPTED_LAYERS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def rank_part(lora_a: torch.Tensor, lora_b: torch.Tensor, split: Any, shard: str) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of an adapter on one shard, cut as the layer's weight is: a column-parallel
    layer (``split.dim`` 0) keeps its output rows of B, a row-parallel one its input columns of A,
    whose partial deltas the layer's all-reduce then sums with its partial products."""
    if split is None:
        return lora_a, lora_b
    start, length = split.ranges[shard]
    if split.dim == 0:
        return lora_a, lora_b.narrow(0, start, length)
    return lora_a.narrow(1, start, length), lora_b


class AdaptableModel(Protocol):
    """What the manager needs of a model (pagellm.models.decoder.CausalLM has it)."""

    def linear_layers(self) -> list[tuple[str, torch.nn.Module]]: ...

    def checkpoint_target(self, name: str) -> tuple[str, Optional[str]]: ...


class LoRAModelManager:
    def __init__(
        self,
        model: AdaptableModel,
        max_loras: int,
        max_lora_rank: int,
        max_cpu_loras: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        loader: Callable[[str, int], PEFTAdapter] = load_peft_adapter,
    ) -> None:
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.context = LoRAStepContext()
        self._checkpoint_target = model.checkpoint_target
        self._loader = loader
        self.layers: dict[str, LoRALayerWeights] = {}
        # Under tensor parallelism, each layer's part of the checkpoint tensor on this rank
        # (pagellm.layers.linear.TPSplit): an adapter is cut the same way as the layer's weight.
        self._splits: dict[str, Any] = {}
        for name, layer in model.linear_layers():
            if name.rsplit(".", 1)[-1] in ADAPTED_LAYERS:
                weights = LoRALayerWeights(layer.in_features, layer.shard_sizes, max_loras, max_lora_rank, self.context, dtype, device)
                layer.lora = weights
                self.layers[name] = weights
                self._splits[name] = getattr(layer, "tp_split", None)
        if not self.layers:
            raise ValueError("this model has no layers LoRA adapters can target")
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # lora id -> slot, least recently used first
        self._free_slots = list(range(max_loras))
        self._cpu: OrderedDict[int, PEFTAdapter] = OrderedDict()
        self._known: dict[int, LoRARequest] = {}
        self._request_lora: dict[str, LoRARequest] = {}

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.layers.values())

    # ---- adapters ----------------------------------------------------------------------

    def add_lora(self, lora: LoRARequest) -> PEFTAdapter:
        """Loads (or finds in the CPU cache) and checks an adapter; ValueError if it cannot be served."""
        known = self._known.get(lora.lora_int_id)
        if known is not None and known.lora_path != lora.lora_path:
            raise ValueError(f"lora_int_id {lora.lora_int_id} is already {known.lora_name!r} at {known.lora_path!r}")
        adapter = self._cpu.get(lora.lora_int_id)
        if adapter is None:
            adapter = self._loader(lora.lora_path, self.max_lora_rank)
            for module in adapter.modules:
                self._layer_and_shard(module)  # refuses modules this model has no adapted layer for
            self._cpu[lora.lora_int_id] = adapter
            while len(self._cpu) > self.max_cpu_loras:
                self._cpu.popitem(last=False)
        self._cpu.move_to_end(lora.lora_int_id)
        self._known[lora.lora_int_id] = lora
        return adapter

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forgets an adapter and frees its slot; a running request on it reloads it from its path
        at its next step, so a later adapter under the same id never finds the old weights."""
        found = self._known.pop(lora_int_id, None) is not None
        self._cpu.pop(lora_int_id, None)
        if lora_int_id in self._slot_of:
            self._free_slots.append(self._slot_of.pop(lora_int_id))
        return found

    def _layer_and_shard(self, module: str) -> tuple[str, Optional[str]]:
        """The adapted layer's name and the shard a checkpoint module lands in."""
        fused, shard = self._checkpoint_target(f"{module}.weight")
        name = fused.removesuffix(".weight")
        if name not in self.layers:
            raise ValueError(f"LoRA module {module!r} matches no adapted layer of this model")
        return name, shard

    def _activate(self, lora: LoRARequest, in_use: set[int]) -> int:
        """The slot holding the adapter, loading it into the least recently used free one."""
        lora_int_id = lora.lora_int_id
        if lora_int_id in self._slot_of:
            self._slot_of.move_to_end(lora_int_id)
            return self._slot_of[lora_int_id]
        if not self._free_slots:
            victim = next((i for i in self._slot_of if i not in in_use), None)
            if victim is None:
                raise RuntimeError(f"more than max_loras={self.max_loras} adapters in one step")
            self._free_slots.append(self._slot_of.pop(victim))
        slot = self._free_slots.pop()
        adapter = self.add_lora(lora)
        per_layer: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        for module, weights in adapter.modules.items():
            name, shard = self._layer_and_shard(module)
            per_layer.setdefault(name, {})[shard or ""] = rank_part(weights.lora_a, weights.lora_b, self._splits[name], shard or "")
        for name, layer in self.layers.items():
            if name in per_layer:
                layer.set_slot(slot, per_layer[name])
            else:
                layer.clear_slot(slot)
        self._slot_of[lora_int_id] = slot
        return slot

    # ---- requests and steps ------------------------------------------------------------

    def add_request(self, req_id: str, lora: Optional[LoRARequest]) -> None:
        if lora is None:
            return
        if lora.lora_int_id not in self._known:
            self.add_lora(lora)
        self._request_lora[req_id] = lora

    def remove_request(self, req_id: str) -> None:
        self._request_lora.pop(req_id, None)

    def prepare_step(self, req_ids: list[str], num_rows: list[int]) -> None:
        """Puts the step's adapters in slots and publishes its segments (requests in batch order)."""
        loras = [self._request_lora.get(r) for r in req_ids]
        in_use = {lora.lora_int_id for lora in loras if lora is not None}
        if len(in_use) > self.max_loras:
            raise RuntimeError(f"{len(in_use)} adapters in one step; the scheduler admits at most max_loras={self.max_loras}")
        slots = [self._activate(lora, in_use) if lora is not None else -1 for lora in loras]
        self.context.batch = LoRABatch.from_rows(num_rows, slots)
