"""Gemma 4 (text): Gemma 3's layer (q/k norms, five sliding layers to one full, a norm before and
after attention and MLP, embeddings scaled by sqrt(hidden)) with what Gemma 4 adds, as
transformers' ``Gemma4TextModel`` computes it:

- per-layer head sizes (``per_layer_config``): full layers have wider heads (``global_head_dim``),
  maybe their own KV head count, and with ``attention_k_eq_v`` their values are the keys'
  projection; full layers rotate by proportional RoPE, sliding ones by plain RoPE;
- values RMS-normalised per head without a weight, attention scale 1.0, plain ``w`` norms;
- per-layer inputs: a second embedding (``embed_tokens_per_layer``) mixed with a projection of the
  embeddings, one slice per layer, gated into the stream after the MLP; a learnt scalar per layer;
- the last ``num_kv_shared_layers`` layers compute no keys or values: each attends over the KV of
  the last earlier layer of its kind (``kv_shared_layers``), which the KV cache hands it.
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch
from torch import nn

from pagellm.attention.backend import AttentionBackend, AttentionMetadata
from pagellm.distributed.parallel_state import get_tp_group
from pagellm.distributed.partition import TPShard, split_evenly
from pagellm.layers.activation import canonical_activation, plain_activation
from pagellm.layers.attention import Attention, AttentionSpec
from pagellm.layers.embedding import VocabParallelEmbedding
from pagellm.layers.linear import Linear
from pagellm.layers.mlp import GatedMLP
from pagellm.layers.moe import FusedMoE
from pagellm.layers.norm import RMSNorm
from pagellm.layers.rotary import RotaryArgs, RotaryEmbedding
from pagellm.models.decoder import CausalLM, DecoderModel
from pagellm.models.shape import FULL, SLIDING, layer_sliding_windows

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def global_attr(hf_config: PretrainedConfig, name: str, default: Any = None) -> Any:
    """A config field as the config states it for the whole model, also where ``per_layer_config``
    overrides it for some layers (transformers then refuses a plain read)."""
    read = getattr(hf_config, "_getattr_without_heterogeneous_validation", None)
    return read(name, default) if read is not None else getattr(hf_config, name, default)


def layer_config(hf_config: PretrainedConfig, layer: int | str) -> PretrainedConfig:
    """The config of one layer (an index) or layer kind, its overrides applied."""
    per_layer = getattr(hf_config, "per_layer_config", None)
    return per_layer[layer] if per_layer is not None and getattr(hf_config, "is_heterogeneous", False) else hf_config


def layer_kv_heads(hf_config: PretrainedConfig) -> tuple[tuple[int, int], ...]:
    """Per layer, (KV heads, head size)."""
    out = []
    for i in range(int(hf_config.num_hidden_layers)):
        cfg = layer_config(hf_config, i)
        out.append((int(global_attr(cfg, "num_key_value_heads")), int(global_attr(cfg, "head_dim"))))
    return tuple(out)


def kv_sources(hf_config: PretrainedConfig) -> tuple[tuple[int, int], ...]:
    """(layer, source) for the last ``num_kv_shared_layers`` layers: each reads the KV of the last
    earlier layer of its kind, as transformers' ``kv_sharing_modes`` pairs them."""
    num_layers, num_shared = int(hf_config.num_hidden_layers), int(getattr(hf_config, "num_kv_shared_layers", 0) or 0)
    first = num_layers - num_shared
    if num_shared and first < 1:
        raise ValueError(f"num_kv_shared_layers={num_shared} leaves no layer of {num_layers} that computes its own KV")
    kinds = [SLIDING if w is not None else FULL for w in layer_sliding_windows(hf_config)]
    last = {kind: i for i, kind in enumerate(kinds[:first])}
    missing = sorted({kinds[i] for i in range(first, num_layers)} - set(last))
    if missing:
        raise ValueError(f"layers of kind {missing} read the KV of an earlier layer of their kind, and there is none")
    return tuple((i, last[kinds[i]]) for i in range(first, num_layers))


_MOE_NAMES = re.compile(r"^(model\.layers\.\d+)\.(router|experts)\.(proj\.weight|scale|per_expert_scale|gate_up_proj|down_proj)$")


class LayerScalar(nn.Module):
    """One learnt number the layer's output is multiplied by (transformers' ``layer_scalar``)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1))
        self.loaded = False

    def load_checkpoint_tensor(self, kind: str, shard: Optional[str], source: torch.Tensor) -> None:
        if kind != "weight" or shard or source.numel() != 1:
            raise ValueError(f"a layer scalar is one number, not {kind} {tuple(source.shape)}")
        self.weight.data.copy_(source.reshape(1))
        self.loaded = True

    def missing_weights(self) -> list[str]:
        return [] if self.loaded else ["weight"]


class Gemma4MoE(FusedMoE):
    """The experts beside each layer's dense MLP (``enable_moe_block``: the 26B-A4B). Routed on the
    stream itself (the MLP's input before its norm): RMS-normalised without a weight, times
    ``scale`` and 1/sqrt(hidden), then the router's softmax over all experts, the top k
    renormalised and each multiplied by its expert's ``per_expert_scale``."""

    def __init__(self, hf_config: PretrainedConfig) -> None:
        act = canonical_activation(getattr(hf_config, "hidden_activation", None) or "gelu_pytorch_tanh")
        hidden, num_experts = hf_config.hidden_size, int(hf_config.num_experts)
        super().__init__(hidden, num_experts, int(hf_config.top_k_experts), int(hf_config.moe_intermediate_size), act, router_name="proj")
        self.eps = hf_config.rms_norm_eps
        self.scale = nn.Parameter(torch.ones(hidden))
        self.per_expert_scale = nn.Parameter(torch.ones(num_experts))
        self.loaded_scales: set[str] = set()
        self._stream: Optional[torch.Tensor] = None

    def load_checkpoint_tensor(self, kind: str, shard: Optional[str], source: torch.Tensor) -> None:
        """The router's two scales, and the experts stacked as transformers keeps them: ``gate_up_proj``
        ``[experts, 2 * inter, hidden]`` (gate rows, then up rows), ``down_proj`` ``[experts, hidden, inter]``."""
        if kind in ("scale", "per_expert_scale"):
            getattr(self, kind).data.copy_(source)
            self.loaded_scales.add(kind)
        elif kind in ("gate_up_proj", "down_proj") and source.shape[0] == len(self.experts):
            for expert, part in zip(self.experts, source):
                if kind == "gate_up_proj":
                    inter = part.shape[0] // 2
                    expert.gate_up_proj.load_checkpoint_tensor("weight", "gate", part[:inter])
                    expert.gate_up_proj.load_checkpoint_tensor("weight", "up", part[inter:])
                else:
                    expert.down_proj.load_checkpoint_tensor("weight", None, part)
        else:
            super().load_checkpoint_tensor(kind, shard, source)

    def missing_weights(self) -> list[str]:
        return sorted({"scale", "per_expert_scale"} - self.loaded_scales) + super().missing_weights()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        stream = self._stream.float()
        normed = (stream * torch.pow(stream.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)).to(x.dtype)
        logits = self._modules[self.router_name](normed * self.scale * stream.shape[-1] ** -0.5).float()
        weights, expert_ids = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True) * self.per_expert_scale[expert_ids]
        return weights.to(x.dtype), expert_ids

    def forward(self, x: torch.Tensor, stream: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """The experts' sum for ``x`` (the stream after pre_feedforward_layernorm_2), routed on ``stream``."""
        self._stream = stream
        try:
            return super().forward(x)
        finally:
            self._stream = None


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, hf_config: PretrainedConfig, layer_idx: int, attn_backend: AttentionBackend, kv_source: Optional[int]) -> None:
        super().__init__()
        window = layer_sliding_windows(hf_config)[layer_idx]
        self.layer_type = SLIDING if window is not None else FULL
        num_kv_heads, head_dim = layer_kv_heads(hf_config)[layer_idx]
        hidden, eps, num_heads = hf_config.hidden_size, hf_config.rms_norm_eps, hf_config.num_attention_heads
        bias = bool(getattr(hf_config, "attention_bias", False))
        spec = AttentionSpec(
            hidden_size=hidden,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            scale=1.0,
            qkv_bias=bias,
            o_bias=bias,
            qk_norm=True,
            qk_norm_eps=eps,
            sliding_window=window,
            v_norm=True,
            k_eq_v=bool(getattr(hf_config, "attention_k_eq_v", False)) and window is None,
            kv_shared=kv_source is not None,
        )
        tp = get_tp_group()
        shard = TPShard.of(tp.rank, tp.world_size, num_heads, num_kv_heads, hf_config.intermediate_size, hf_config.vocab_size)
        self.self_attn = Attention(spec, layer_idx, attn_backend, shard)
        act = getattr(hf_config, "hidden_activation", None) or "gelu_pytorch_tanh"
        wide = bool(getattr(hf_config, "use_double_wide_mlp", False)) and kv_source is not None
        self.mlp = GatedMLP(hidden, hf_config.intermediate_size * (2 if wide else 1), canonical_activation(act))
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps)
        self.layer_scalar = LayerScalar()
        self.moe = None
        if getattr(hf_config, "enable_moe_block", False):
            self.moe = Gemma4MoE(hf_config)
            self.post_feedforward_layernorm_1 = RMSNorm(hidden, eps)
            self.pre_feedforward_layernorm_2 = RMSNorm(hidden, eps)
            self.post_feedforward_layernorm_2 = RMSNorm(hidden, eps)
        per_layer = int(getattr(hf_config, "hidden_size_per_layer_input", 0) or 0)
        if per_layer:  # small: every rank holds all of it
            self.act = plain_activation(act)  # the model's hidden_activation, on its own
            self.per_layer_input_gate = Linear(hidden, per_layer)
            self.per_layer_projection = Linear(per_layer, hidden)
            self.post_per_layer_input_norm = RMSNorm(hidden, eps)

    def forward(
        self, hidden: torch.Tensor, residual: None, rope: RotaryArgs, kv_cache: torch.Tensor, attn_metadata: AttentionMetadata,
        per_layer_input: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, None]:
        """(the stream after this layer, None): the layer scales all of the stream, so no residual add
        is ever left pending (``residual`` is the previous layer's None)."""
        out = self.post_attention_layernorm(self.self_attn(self.input_layernorm(hidden), rope, kv_cache, attn_metadata))
        normed, hidden = self.pre_feedforward_layernorm(out, hidden)
        out = self.mlp(normed)
        if self.moe is not None:
            experts = self.moe(self.pre_feedforward_layernorm_2(hidden), hidden)
            out = self.post_feedforward_layernorm_1(out) + self.post_feedforward_layernorm_2(experts)
        hidden = hidden + self.post_feedforward_layernorm(out)
        if per_layer_input is not None:
            gate = self.act(self.per_layer_input_gate(hidden)) * per_layer_input
            hidden = hidden + self.post_per_layer_input_norm(self.per_layer_projection(gate))
        return hidden * self.layer_scalar.weight, None


class Gemma4Model(DecoderModel):
    """The decoder, the per-layer input embeddings, and a rotary table per layer kind (each from
    that kind's head size)."""

    def __init__(self, hf_config: PretrainedConfig, layers: Sequence[Gemma4DecoderLayer]) -> None:
        hidden = hf_config.hidden_size
        super().__init__(hf_config, layers, embed_scale=hidden**0.5, rotary_layer_types=())
        self.rotary = {kind: RotaryEmbedding(layer_config(hf_config, kind), kind) for kind in {la.layer_type for la in layers}}
        self.num_layers = len(layers)
        self.per_layer = int(getattr(hf_config, "hidden_size_per_layer_input", 0) or 0)
        if self.per_layer:
            tp, rows = get_tp_group(), int(hf_config.vocab_size_per_layer_input)
            pieces = split_evenly(rows, tp.world_size)
            start, size = pieces[tp.rank]
            width = self.num_layers * self.per_layer
            padded = rows if tp.world_size == 1 else pieces[0][1]
            self.embed_tokens_per_layer = VocabParallelEmbedding(padded, width, start, size, self.per_layer**0.5)
            self.per_layer_model_projection = Linear(hidden, width)
            self.per_layer_projection_norm = RMSNorm(self.per_layer, hf_config.rms_norm_eps)
            self.per_layer_vocab = rows

    def per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> Optional[torch.Tensor]:
        """``[T, layers, per_layer]``: the token's per-layer embedding and the normed projection of
        its embedding, averaged (times 1/sqrt(2), as transformers); None without per-layer inputs."""
        if not self.per_layer:
            return None
        num_tokens = input_ids.shape[0]
        # Ids past the per-layer table (image and audio tokens) look up nothing, as transformers' pad row.
        ids = input_ids.masked_fill(input_ids >= self.per_layer_vocab, 0)
        token = self.embed_tokens_per_layer(ids).view(num_tokens, self.num_layers, self.per_layer)
        proj = self.per_layer_model_projection(embeds) * embeds.shape[-1] ** -0.5
        proj = self.per_layer_projection_norm(proj.reshape(-1, self.per_layer)).view(num_tokens, self.num_layers, self.per_layer)
        return (proj + token) * 2.0**-0.5



class Gemma4ForCausalLM(CausalLM):
    @classmethod
    def kv_shared_layers(cls, hf_config: PretrainedConfig) -> tuple[tuple[int, int], ...]:
        return kv_sources(hf_config)

    @classmethod
    def layer_kv_heads(cls, hf_config: PretrainedConfig) -> tuple[tuple[int, int], ...]:
        return layer_kv_heads(hf_config)

    def __init__(self, hf_config: PretrainedConfig, attn_backend: AttentionBackend) -> None:
        if "num_key_value_heads" in (getattr(hf_config, "per_layer_attributes", None) or ()):
            # The engine's shared code reads one KV head count (the sliding layers'); each layer reads its own.
            hf_config.allow_global_per_layer_attribute_access = True
        super().__init__(hf_config, attn_backend)
        self.final_logit_softcapping = getattr(hf_config, "final_logit_softcapping", None)

    def build_model(self, hf_config: PretrainedConfig, attn_backend: AttentionBackend) -> DecoderModel:
        sources = dict(kv_sources(hf_config))
        layers = [Gemma4DecoderLayer(hf_config, i, attn_backend, sources.get(i)) for i in range(hf_config.num_hidden_layers)]
        for layer, source in sources.items():  # an 8-bit cache's scales are the writer's
            layers[layer].self_attn.kv_scales = layers[source].self_attn.kv_scales
        return Gemma4Model(hf_config, layers)

    def checkpoint_target(self, name: str) -> tuple[str, Optional[str]]:
        if name.endswith(".layer_scalar"):  # a buffer in transformers, a one-number module here
            name += ".weight"
        # transformers' router and stacked experts are one module here (its experts, router proj and scales).
        name = _MOE_NAMES.sub(r"\1.moe.\3", name)
        return super().checkpoint_target(name)

    def finish_loading(self, precision, device, dtype) -> None:
        super().finish_loading(precision, device, dtype)
        if self.model.per_layer:
            self.model.embed_tokens_per_layer.process_weights_after_loading(device, dtype, precision, self.kernels)
