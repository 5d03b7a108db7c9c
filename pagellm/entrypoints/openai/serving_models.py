"""The models the server answers to (vLLM's ``OpenAIServingModels``): the base model and each LoRA
adapter by name, listed at ``/v1/models``, loaded and unloaded at run time."""
from __future__ import annotations

import itertools
import json
from typing import Optional

from pagellm.engine.async_llm import AsyncLLM
from pagellm.entrypoints.errors import APIError
from pagellm.entrypoints.openai.protocol import ModelCard, ModelList
from pagellm.lora.request import LoRARequest


def parse_lora_module(spec: str) -> tuple[str, str, Optional[str]]:
    """``name=path`` or vLLM's JSON ``{"name": ..., "path": ..., "base_model_name": ...}`` -> (name, path, base)."""
    if spec.lstrip().startswith("{"):
        try:
            item = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-modules {spec!r} is not valid JSON: {e}") from None
        if not isinstance(item, dict) or not item.get("name") or not item.get("path"):
            raise ValueError(f"--lora-modules {spec!r} needs \"name\" and \"path\"")
        return str(item["name"]), str(item["path"]), item.get("base_model_name")
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {spec!r}: use name=path or a JSON object")
    return name, path, None


class OpenAIServingModels:
    def __init__(self, async_llm: AsyncLLM, base_model_name: str, model_root: Optional[str] = None) -> None:
        self.async_llm = async_llm
        self.base_model_name = base_model_name
        self.model_root = model_root or base_model_name
        self.loras: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def resolve(self, model: Optional[str]) -> Optional[LoRARequest]:
        """The adapter a request's ``model`` names (None: the base model); 404 for an unknown name."""
        if not model or model == self.base_model_name:
            return None
        lora = self.loras.get(model)
        if lora is None:
            raise APIError(f"The model `{model}` does not exist.", 404, param="model")
        return lora

    def list_models(self) -> ModelList:
        max_len = self.async_llm.max_model_len
        cards = [ModelCard(id=self.base_model_name, root=self.model_root, max_model_len=max_len)]
        cards += [
            ModelCard(id=name, root=lora.lora_path, parent=lora.base_model_name or self.base_model_name, max_model_len=max_len)
            for name, lora in self.loras.items()
        ]
        return ModelList(data=cards)

    def register(self, name: str, path: str, base_model_name: Optional[str] = None) -> LoRARequest:
        """Names an adapter (not loaded yet); ValueError for a name already taken."""
        if name == self.base_model_name or name in self.loras:
            raise ValueError(f"a model named {name!r} is already served")
        lora = LoRARequest(name, next(self._ids), path, base_model_name)
        self.loras[name] = lora
        return lora

    async def load_lora_adapter(self, name: Optional[str], path: Optional[str]) -> str:
        if not name or not path:
            raise APIError("both lora_name and lora_path must be given", param="lora_name")
        if name in self.loras or name == self.base_model_name:
            raise APIError(f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        lora = self.register(name, path)
        try:
            await self.async_llm.run_in_engine(lambda engine: engine.add_lora(lora))
        except BaseException:
            del self.loras[name]
            raise
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload_lora_adapter(self, name: Optional[str]) -> str:
        lora = self.loras.pop(name or "", None)
        if lora is None:
            raise APIError(f"The lora adapter '{name}' cannot be found.", 404, param="lora_name")
        await self.async_llm.run_in_engine(lambda engine: engine.remove_lora(lora.lora_int_id))
        return f"Success: LoRA adapter '{name}' removed successfully."
