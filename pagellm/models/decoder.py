"""What every decoder-only model here shares: the model runner's interface (forward over a flat
token batch and a paged KV cache, logits, weight loading and accounting), built from the layer
library. A model file subclasses :class:`CausalLM` and states only how one of its layers is made
and how its checkpoint names its tensors.

Module names follow Hugging Face, so ``model.layers.3.self_attn.o_proj.weight`` loads into the
module of the same name; projections a checkpoint stores apart (q/k/v, gate/up) load into one
fused layer as its shards (``stacked_params``). Each module with weights cuts its own tensor-
parallel part (``load_checkpoint_tensor``), so loading is one loop for every architecture.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from pagellm.attention.backend import AttentionBackend, AttentionMetadata
from pagellm.attention.kv_quant import KVScales
from pagellm.config import EXACT_LINEAR, LinearPrecision
from pagellm.distributed.parallel_state import get_tp_group
from pagellm.distributed.partition import TPShard
from pagellm.kernels import ops
from pagellm.kernels.context import KernelContext
from pagellm.kernels.tuning import F32_PANELS, PackedForms
from pagellm.layers.attention import Attention
from pagellm.layers.embedding import VocabParallelEmbedding
from pagellm.layers.gguf_types import GGUFWeight
from pagellm.layers.linear import Linear, TPSplit
from pagellm.layers.linear_method import WeightSource
from pagellm.layers.norm import RMSNorm
from pagellm.layers.rotary import RotaryArgs, RotaryEmbedding

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# (fused module, checkpoint module, shard) for projections stored apart and computed as one.
LLAMA_STACKED_PARAMS: tuple[tuple[str, str, Optional[str]], ...] = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", "gate"),
    ("gate_up_proj", "up_proj", "up"),
)
# An image-and-text checkpoint's language model under its text-only names (the layouts transformers
# saves and older hub checkpoints use).
_TEXT_MODEL_PREFIXES = {"language_model.model.": "model.", "model.language_model.": "model.", "language_model.lm_head.": "lm_head."}
# Tensors of a checkpoint that the served text model has no part in, as transformers' causal-LM classes
# skip them: an image-text checkpoint's vision tower and projector (Qwen3.5's is model.visual; Gemma 4's
# audio tower and its image and audio embedders too), and the multi-token-prediction head that Qwen3.5,
# Qwen3-Next and Nemotron-H checkpoints carry (mtp.*).
_UNSERVED_PREFIXES = (
    "vision_tower.", "multi_modal_projector.", "audio_tower.", "embed_vision.", "embed_audio.",
    "model.vision_tower.", "model.multi_modal_projector.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.",
    "model.visual.", "mtp.",
)
# Buffers some checkpoints carry that we compute ourselves instead.
_IGNORED_WEIGHT_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
# An 8-bit checkpoint's KV cache scales, as its quantizer names them (compressed-tensors, AutoFP8's
# output scales, the older shared kv_scale): which of (k, v) each sets.
_KV_SCALE_SUFFIXES = {
    ".self_attn.k_scale": "k",
    ".self_attn.v_scale": "v",
    ".self_attn.attn.k_scale": "k",
    ".self_attn.attn.v_scale": "v",
    ".self_attn.k_proj.output_scale": "k",
    ".self_attn.v_proj.output_scale": "v",
    ".self_attn.kv_scale": "kv",
}


def distinct_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes the tensors' data cover, memory that several of them hold (a tied head's table is
    the embedding's) counted once: the union of their byte ranges on each device, a tensor's range
    its ``nbytes`` from its first byte. Views of one storage (the panels mapped from one
    packed-weights file) count each its own bytes."""
    ranges: dict[torch.device, list[tuple[int, int]]] = {}
    for tensor in tensors:
        if tensor.nbytes:
            start = tensor.data_ptr()
            ranges.setdefault(tensor.device, []).append((start, start + tensor.nbytes))
    total = 0
    for spans in ranges.values():
        covered = 0  # the end of what is counted so far (addresses only grow in sorted order)
        for start, end in sorted(spans):
            total += max(0, end - max(start, covered))
            covered = max(covered, end)
    return total


def tp_shard_of(hf_config: PretrainedConfig) -> TPShard:
    """This process's slice of the model under its tensor-parallel group (all of it without one)."""
    tp = get_tp_group()
    num_heads = hf_config.num_attention_heads
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    inter = getattr(hf_config, "intermediate_size", None) or getattr(hf_config, "moe_intermediate_size", None) or 1
    return TPShard.of(tp.rank, tp.world_size, num_heads, num_kv_heads, inter, hf_config.vocab_size)


class DecoderLayer(nn.Module):
    """A pre-norm block: ``x + attn(norm(x))``, then ``+ mlp(norm(.))``. Layers take and return
    ``(hidden, residual)`` with the residual add still pending, so each norm folds it in."""

    def __init__(
        self,
        self_attn: nn.Module,
        mlp: nn.Module,
        hidden_size: int,
        eps: float,
        layer_type: Optional[str] = None,
        mlp_name: str = "mlp",
        mixer_name: str = "self_attn",
        norm_offset: float = 0.0,
    ) -> None:
        super().__init__()
        # The token mixer (attention, or a hybrid model's recurrent layer: Qwen3.5's linear_attn)
        # and the MLP, each registered under the checkpoint's name for it (Mixtral: block_sparse_moe).
        self.mixer_name, self.mlp_name = mixer_name, mlp_name
        self.add_module(mixer_name, self_attn)
        self.add_module(mlp_name, mlp)
        self.input_layernorm = RMSNorm(hidden_size, eps, norm_offset)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps, norm_offset)
        self.layer_type = layer_type  # which rotary table the layer reads (None: the model's one)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: Optional[torch.Tensor],
        rope: RotaryArgs,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self._modules[self.mixer_name](hidden, rope, kv_cache, attn_metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self._modules[self.mlp_name](hidden), residual


class DecoderModel(nn.Module):
    """Embedding, the layers, the final norm, and one rotary table per layer kind."""

    def __init__(
        self,
        hf_config: PretrainedConfig,
        layers: Sequence[nn.Module],
        embed_scale: Optional[float] = None,
        rotary_layer_types: Sequence[Optional[str]] = (None,),
        final_norm_offset: float = 0.0,
        norm_eps: Optional[float] = None,
    ) -> None:
        super().__init__()
        tp, shard = get_tp_group(), tp_shard_of(hf_config)
        rows = hf_config.vocab_size if tp.world_size == 1 else shard.vocab_padded
        self.embed_tokens = VocabParallelEmbedding(rows, hf_config.hidden_size, shard.vocab_start, shard.vocab_size, embed_scale)
        self.layers = nn.ModuleList(layers)
        # The final norm's eps: ``rms_norm_eps`` unless the config names it otherwise (LFM2, Nemotron-H).
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps if norm_eps is None else norm_eps, final_norm_offset)
        # Not submodules: they hold no weights, only tables built on first use.
        self.rotary = {kind: RotaryEmbedding(hf_config, kind) for kind in rotary_layer_types}

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[torch.Tensor],
        attn_metadata: AttentionMetadata | Sequence[AttentionMetadata],
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        fused = ops.supports(hidden)
        # Prepared once per layer kind: every layer of a kind rotates by the same positions.
        ropes = {kind: emb.prepare(positions, hidden.dtype, fused=fused) for kind, emb in self.rotary.items()}
        per_layer = isinstance(attn_metadata, (list, tuple))
        layer_inputs = self.per_layer_inputs(input_ids, hidden)
        residual = None
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            # No rotary kinds (a NoPE model): every layer gets None.
            rope = ropes[layer.layer_type] if layer.layer_type in ropes else next(iter(ropes.values()), None)
            metadata = attn_metadata[i] if per_layer else attn_metadata
            if layer_inputs is None:
                hidden, residual = layer(hidden, residual, rope, kv_cache, metadata)
            else:
                hidden, residual = layer(hidden, residual, rope, kv_cache, metadata, layer_inputs[:, i])
        return self.norm.add_and_norm(hidden, residual)[0]

    def per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> Optional[torch.Tensor]:
        """``[T, layers, ...]``: what layer ``i`` reads besides the stream, as its last argument (Gemma 4's
        per-layer embeddings); None (the layers read the stream only) here."""
        return None


class CausalLM(nn.Module):
    """A decoder and its vocabulary head. Subclasses build ``self.model`` (a :class:`DecoderModel`)
    in :meth:`build_model` and may extend ``stacked_params``."""

    stacked_params: tuple[tuple[str, str, Optional[str]], ...] = LLAMA_STACKED_PARAMS
    # Gemma 2: the final logits become cap * tanh(logits / cap).
    final_logit_softcapping: Optional[float] = None

    def __init__(self, hf_config: PretrainedConfig, attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.config = hf_config
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.tp = get_tp_group()
        self.shard = tp_shard_of(hf_config)
        self.vocab_size = hf_config.vocab_size
        # What the layers' kernels read at call time; load_weights takes the load's own.
        self.kernels = KernelContext()
        self.model = self.build_model(hf_config, attn_backend)
        parallel = self.tp.world_size > 1
        head_rows = self.shard.vocab_padded if parallel else hf_config.vocab_size
        # Vocabulary-parallel: each rank's rows, the last piece padded so the gather has equal parts.
        split = TPSplit(0, {"": (self.shard.vocab_start, self.shard.vocab_size)}, pad_rows=head_rows) if parallel else None
        # Tied models multiply by the embedding rows: the head is built from them after loading.
        self.lm_head = Linear(hf_config.hidden_size, head_rows, bias=False, tp_split=split)

    def build_model(self, hf_config: PretrainedConfig, attn_backend: AttentionBackend) -> DecoderModel:
        raise NotImplementedError

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    def attention_layers(self) -> list[Attention]:
        return [m for m in self.modules() if isinstance(m, Attention)]

    def kv_scales(self) -> list[KVScales]:
        """Each layer's KV cache scales, in layer order."""
        return [attn.kv_scales for attn in self.attention_layers()]

    def _load_kv_scale(self, name: str, tensor: WeightSource) -> bool:
        """Takes a checkpoint's KV cache scale if ``name`` is one; returns whether it was."""
        for suffix, which in _KV_SCALE_SUFFIXES.items():
            if name.endswith(suffix) and name.startswith("model.layers."):
                layer = int(name.removeprefix("model.layers.").partition(".")[0])
                value = tensor.dequantize() if isinstance(tensor, GGUFWeight) else tensor
                if value.numel() != 1:
                    raise ValueError(f"checkpoint KV cache scale {name!r} must hold one number, not {tuple(value.shape)}")
                attention = getattr(self.model.layers[layer], "self_attn", None)
                if not isinstance(attention, Attention):  # a hybrid model's recurrent layer has no KV
                    raise ValueError(f"checkpoint KV cache scale {name!r} is for a layer without attention")
                scales = attention.kv_scales
                scale = float(value.float().reshape(()))
                scales.set(scale if "k" in which else scales.k_scale, scale if "v" in which else scales.v_scale)
                return True
        return False

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[torch.Tensor],
        attn_metadata: AttentionMetadata | Sequence[AttentionMetadata],
    ) -> torch.Tensor:
        """Final-normed hidden states ``[T, hidden]`` for the flat batch of ``T`` new tokens.
        ``attn_metadata`` is one for all layers, or one per layer (each its KV group's)."""
        if len(kv_caches) != self.num_layers:
            raise ValueError(f"expected one KV cache per layer ({self.num_layers}), got {len(kv_caches)}.")
        if isinstance(attn_metadata, (list, tuple)) and len(attn_metadata) != self.num_layers:
            raise ValueError(f"expected attention metadata per layer ({self.num_layers}), got {len(attn_metadata)}.")
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits ``[N, vocab]`` in float32 for the rows of ``hidden`` that need them."""
        logits = self.lm_head(hidden)
        if self.tp.world_size > 1:
            # Vocab-parallel head: each rank's rows of the vocabulary, gathered in rank order.
            logits = self.tp.all_gather(logits, dim=-1)[:, : self.vocab_size]
        logits = logits.float()
        if self.final_logit_softcapping:
            cap = float(self.final_logit_softcapping)
            logits = torch.tanh(logits / cap) * cap
        return logits

    def linear_layers(self) -> list[tuple[str, Linear]]:
        """Every linear layer by name, the vocabulary head first."""
        return [("lm_head", self.lm_head)] + [(n, m) for n, m in self.model.named_modules(prefix="model") if isinstance(m, Linear)]

    def finish_loading(self, precision: LinearPrecision, device: torch.device | str, dtype: torch.dtype) -> None:
        """After every tensor is in: a tied head is built from the embedding rows, and the
        embedding moves to ``device`` off the CPU."""
        embed = self.model.embed_tokens
        embed.process_weights_after_loading(device, dtype, precision, self.kernels)
        if not self.tie_word_embeddings:
            return
        if embed.packed is not None:  # one copy of the table: the head multiplies by its panels
            self.lm_head.method = embed.packed
            return
        self.lm_head.load_shard(None, embed.source_rows(self.lm_head.out_features))
        self.lm_head.process_weights_after_loading(precision, device, dtype, self.kernels)
        panels = self.lm_head.method.rows_as_bf16_panels()
        if panels is not None:
            embed.share_head_panels(panels)  # one copy of a bfloat16 table

    def weight_bytes(self) -> int:
        """Bytes the model's weights hold resident: its parameters and what every layer that keeps
        weights beside them reports (``resident_tensors``), memory two of them share counted once."""
        tensors = list(self.parameters())
        for module in self.modules():
            resident = getattr(module, "resident_tensors", None)
            if resident is not None:
                tensors += resident()
        return distinct_bytes(tensors)

    def packed_weights(self) -> list[tuple[torch.Tensor, PackedForms]]:
        """``(weight, packed)`` of every layer whose form the start-up measurement of the float32
        panels' row limit decides (:func:`pagellm.kernels.tuning.measure_cpu_tuning` times its
        kernel on them), the vocabulary head first."""
        probes = (layer.method.tuning_probe(F32_PANELS) for _, layer in self.linear_layers() if layer.method is not None)
        return [probe for probe in probes if probe is not None]

    def checkpoint_target(self, name: str) -> tuple[str, Optional[str]]:
        """(our parameter name, fused shard) for a checkpoint tensor name."""
        for fused, part, shard in self.stacked_params:
            if f".{part}." in name:
                return name.replace(f".{part}.", f".{fused}."), shard
        return name, None

    def load_weights(
        self,
        weights: Iterable[tuple[str, WeightSource]],
        precision: LinearPrecision = EXACT_LINEAR,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        kernels: Optional[KernelContext] = None,
    ) -> set[str]:
        """Takes Hugging Face-named tensors as stored, each into the module that owns it (which
        cuts its rank's part). A linear layer is processed into its method for ``precision`` as
        soon as all its shards are in, so only one layer's tensors as stored are held at a time.
        ``kernels`` (kept as :attr:`kernels`) is handed to every layer processed: each pack goes
        through its pack session, and the kernels read this machine's tuning from it.

        Returns the names that were filled. Raises ValueError on an unknown name, a shape
        mismatch, or a weight the checkpoint never provided.
        """
        if kernels is not None:
            self.kernels = kernels
        modules = dict(self.named_modules())
        filled: set[str] = set()
        for name, tensor in weights:
            if name.startswith(_UNSERVED_PREFIXES):
                continue
            for prefix, replacement in _TEXT_MODEL_PREFIXES.items():
                if name.startswith(prefix):
                    name = replacement + name.removeprefix(prefix)
                    break
            if name.endswith(_IGNORED_WEIGHT_SUFFIXES) or self._load_kv_scale(name, tensor):
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue  # tied: some checkpoints still store a copy of the embeddings
            target, shard = self.checkpoint_target(name)
            owner_name, _, kind = target.rpartition(".")
            owner = modules.get(owner_name)
            if owner is None or not hasattr(owner, "load_checkpoint_tensor"):
                raise ValueError(f"checkpoint weight {name!r} has no matching parameter in {type(self).__name__}.")
            if isinstance(tensor, GGUFWeight) and not isinstance(owner, (Linear, VocabParallelEmbedding)):
                tensor = tensor.dequantize()
            try:
                owner.load_checkpoint_tensor(kind, shard, tensor)
            except ValueError as e:
                raise ValueError(f"checkpoint weight {name!r}: {e}") from None
            del tensor
            # A layer is packed as soon as its last shard is in (a stacked expert tensor fills many).
            linears = ([owner] if kind == "weight" else []) if isinstance(owner, Linear) else owner.modules()
            for layer in linears:
                if isinstance(layer, Linear) and layer.method is None and not layer.missing_shards:
                    layer.process_weights_after_loading(precision, device, dtype, self.kernels)
            filled.add(target)
        self._check_complete()
        self.finish_loading(precision, device, dtype)
        return filled

    def _check_complete(self) -> None:
        missing = []
        for name, module in self.named_modules():
            if isinstance(module, Linear):
                if not (name == "lm_head" and self.tie_word_embeddings):
                    missing += [f"{name}.weight[{s}]" if s else f"{name}.weight" for s in module.missing_shards]
                missing += [f"{name}.bias[{s}]" if s else f"{name}.bias" for s in module.missing_bias_shards]
            elif isinstance(module, RMSNorm) and not module.loaded:
                missing.append(f"{name}.weight")
            elif isinstance(module, VocabParallelEmbedding) and not module.loaded:
                missing.append(f"{name}.weight")
            elif isinstance(module, Attention) and module.sinks is not None and module.options.sinks is None:
                missing.append(f"{name}.sinks")
            elif hasattr(module, "missing_weights"):  # a layer's own tensors (a recurrent layer's)
                missing += [f"{name}.{w}" for w in module.missing_weights()]
        if missing:
            raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
