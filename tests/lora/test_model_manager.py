"""The adapter pool on a two-layer stand-in model: slots filled and evicted least recently used
first, the host cache bounded by max_cpu_loras (evicted adapters reload from disk), and adapters
whose modules the model lacks refused."""
from __future__ import annotations

from typing import Optional

import pytest
import torch
from torch import nn

from pagellm.lora.model_manager import LoRAModelManager
from pagellm.lora.peft_adapter import LoRAModuleWeights, PEFTAdapter
from pagellm.lora.request import LoRARequest


class TinyModel(nn.Module):
    """What the manager reads of a model: named linear layers and the checkpoint-name mapping."""

    class Layer:
        def __init__(self, in_features: int, shard_sizes: dict[str, int]) -> None:
            self.in_features, self.shard_sizes, self.lora = in_features, shard_sizes, None

    def __init__(self) -> None:
        super().__init__()
        self.qkv = self.Layer(4, {"q": 4, "k": 2, "v": 2})
        self.down = self.Layer(4, {"": 4})

    def linear_layers(self):
        head = self.Layer(4, {"": 10})
        return [("lm_head", head), ("model.layers.0.self_attn.qkv_proj", self.qkv), ("model.layers.0.mlp.down_proj", self.down)]

    def checkpoint_target(self, name: str) -> tuple[str, Optional[str]]:
        for part, shard in (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")):
            if f".{part}." in name:
                return name.replace(f".{part}.", ".qkv_proj."), shard
        return name, None


def fake_loader(loads: list[str]):
    def load(path: str, max_rank: int) -> PEFTAdapter:
        loads.append(path)
        value = float(path.rsplit("/", 1)[-1])
        module = "model.layers.0.self_attn.q_proj" if value > 0 else "model.layers.0.self_attn.nope_proj"
        weights = LoRAModuleWeights(torch.full((1, 4), value), torch.ones(4, 1))
        return PEFTAdapter(path, 1, 1.0, ("q_proj",), {module: weights, "model.layers.0.mlp.down_proj": weights})

    return load


def lora(i: int) -> LoRARequest:
    return LoRARequest(f"a{i}", i, f"/adapters/{i}")


def test_slots_evict_least_recently_used_and_cpu_cache_reloads():
    loads: list[str] = []
    model = TinyModel()
    manager = LoRAModelManager(model, max_loras=2, max_lora_rank=2, max_cpu_loras=2, loader=fake_loader(loads))
    assert model.qkv.lora is manager.layers["model.layers.0.self_attn.qkv_proj"] and "lm_head" not in manager.layers
    for i in (1, 2, 3):
        manager.add_request(f"r{i}", lora(i))
    assert loads == ["/adapters/1", "/adapters/2", "/adapters/3"]  # adapter 1 left the host cache for 3
    manager.prepare_step(["r1", "r2"], [2, 1])
    # Each left the host cache for the other, so both came back from disk.
    assert loads[3:] == ["/adapters/1", "/adapters/2"]
    batch = manager.context.batch
    slot_1, slot_2 = batch.seg_slots.tolist()
    assert batch.seg_starts.tolist() == [0, 2, 3]
    pool = manager.layers["model.layers.0.self_attn.qkv_proj"].shards["q"]
    assert pool.lora_a[slot_1, 0].tolist() == [1.0] * 4 and pool.lora_a[slot_2, 0].tolist() == [2.0] * 4
    manager.prepare_step(["r2"], [1])  # 2 used last: 1 is the least recently used slot
    manager.prepare_step(["r3", "r2"], [1, 1])
    assert manager.context.batch.seg_slots.tolist() == [slot_1, slot_2]
    assert pool.lora_a[slot_1, 0].tolist() == [3.0] * 4
    with pytest.raises(RuntimeError, match="max_loras=2"):
        manager.prepare_step(["r1", "r2", "r3"], [1, 1, 1])
    manager.prepare_step(["x"], [4])
    assert manager.context.batch is None


def test_unknown_modules_and_reused_ids_are_refused():
    manager = LoRAModelManager(TinyModel(), 1, 2, 1, loader=fake_loader([]))
    with pytest.raises(ValueError, match="matches no adapted layer"):
        manager.add_lora(LoRARequest("bad", 7, "/adapters/-1"))
    manager.add_request("r", lora(1))
    manager.prepare_step(["r"], [1])
    with pytest.raises(ValueError, match="already"):
        manager.add_lora(LoRARequest("other", 1, "/elsewhere/1"))
    assert manager.remove_lora(1) and not manager.remove_lora(1)
    # The id comes back with other weights: the step loads them, not the old slot's.
    manager.add_request("s", LoRARequest("other", 1, "/elsewhere/5"))
    manager.prepare_step(["s"], [1])
    assert manager.layers["model.layers.0.self_attn.qkv_proj"].shards["q"].lora_a[0, 0].tolist() == [5.0] * 4
