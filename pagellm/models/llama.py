"""Llama-family decoder (Llama, Mistral, Qwen2) over a flat token batch and a paged KV cache.

Q/K/V and gate/up are each one fused Linear, stacked from the Hugging Face weights at load time,
so a layer does four matmuls instead of seven; the elementwise work between them goes through the
fused layers of ``pagellm.models.layers``. Module names otherwise follow Hugging Face, so
``model.layers.3.self_attn.o_proj.weight`` loads straight into the parameter of the same name.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from pagellm.attention.backend import AttentionBackend, AttentionMetadata
from pagellm.kernels import ops
from pagellm.kernels.tuning import CpuTuning
from pagellm.models.layers import (
    Linear,
    PackedWeight,
    RMSNorm,
    SiluAndMulLinear,
    linear,
    pack_weight,
    rotate_in_place,
)
from pagellm.models.rope import RotaryArgs, RotaryEmbedding, apply_rotary, head_dim_of

# (fused parameter, checkpoint projection, shard) for the projections we stack at load time.
_STACKED_PROJECTIONS = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", "gate"),
    ("gate_up_proj", "up_proj", "up"),
)
# Buffers some checkpoints carry that we compute ourselves instead.
_IGNORED_WEIGHT_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


class LlamaAttention(nn.Module):
    def __init__(
        self,
        hf_config: PretrainedConfig,
        layer_idx: int,
        attn_backend: AttentionBackend,
        qkv_bias: bool,
        o_bias: bool,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.attn_backend = attn_backend
        self.num_heads = hf_config.num_attention_heads
        self.num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or self.num_heads
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads ({self.num_kv_heads})."
            )
        self.head_dim = head_dim_of(hf_config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = Linear(hf_config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = Linear(self.q_size, hf_config.hidden_size, bias=o_bias)

    def shard_range(self, shard: str) -> tuple[int, int]:
        """(row offset, rows) of one checkpoint projection inside ``qkv_proj``."""
        return {"q": (0, self.q_size), "k": (self.q_size, self.kv_size), "v": (self.q_size + self.kv_size, self.kv_size)}[
            shard
        ]

    def forward(self, hidden: torch.Tensor, rope: RotaryArgs, kv_cache: torch.Tensor, attn_metadata: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        if rope.fused:
            # q and k are rotated where they lie: all three stay views of one buffer, no copies.
            rotate_in_place(qkv, rope.positions, rope.cos, rope.sin, self.num_heads + self.num_kv_heads, self.head_dim)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if not rope.fused:
            q, k = apply_rotary(q, rope.cos, rope.sin), apply_rotary(k, rope.cos, rope.sin)
        if not self.attn_backend.accepts_strided_qkv:
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out = self.attn_backend.forward(q, k, v, kv_cache, attn_metadata, self.scale)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, hf_config: PretrainedConfig, bias: bool) -> None:
        super().__init__()
        act = getattr(hf_config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {act!r} is not supported; Llama-family models here use 'silu'.")
        self.intermediate_size = hf_config.intermediate_size
        # Returns silu(gate) * up directly (the activation fused into the projection's kernel).
        self.gate_up_proj = SiluAndMulLinear(hf_config.hidden_size, 2 * self.intermediate_size, bias=bias)
        self.down_proj = Linear(self.intermediate_size, hf_config.hidden_size, bias=bias)

    def shard_range(self, shard: str) -> tuple[int, int]:
        """(row offset, rows) of one checkpoint projection inside ``gate_up_proj``."""
        return {"gate": (0, self.intermediate_size), "up": (self.intermediate_size, self.intermediate_size)}[shard]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        hf_config: PretrainedConfig,
        layer_idx: int,
        attn_backend: AttentionBackend,
        qkv_bias: bool,
        o_bias: bool,
        mlp_bias: bool,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(hf_config, layer_idx, attn_backend, qkv_bias, o_bias)
        self.mlp = LlamaMLP(hf_config, mlp_bias)
        self.input_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RotaryArgs,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the residual stream before it is added), so the next
        norm can fold that add in. ``residual`` is None for the first layer."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rope, kv_cache, attn_metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(
        self, hf_config: PretrainedConfig, attn_backend: AttentionBackend, qkv_bias: bool, o_bias: bool, mlp_bias: bool
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(hf_config.vocab_size, hf_config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(hf_config, i, attn_backend, qkv_bias, o_bias, mlp_bias)
            for i in range(hf_config.num_hidden_layers)
        )
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(hf_config)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        # Prepared once for all layers: every layer rotates by the same positions.
        rope = self.rotary_emb.prepare(positions, hidden.dtype, fused=ops.supports(hidden))
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(hidden, residual, rope, kv_cache, attn_metadata)
        return self.norm(hidden) if residual is None else self.norm(hidden, residual)[0]


class LlamaForCausalLM(nn.Module):
    """Causal LM head over :class:`LlamaModel`; see the module docstring for the weight layout."""

    def __init__(self, hf_config: PretrainedConfig, attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.config = hf_config
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        qkv_bias, o_bias, mlp_bias = self.bias_flags(hf_config)
        self.model = LlamaModel(hf_config, attn_backend, qkv_bias, o_bias, mlp_bias)
        # Tied models reuse the embedding matrix directly rather than carrying an alias module.
        self.lm_head = None if self.tie_word_embeddings else Linear(hf_config.hidden_size, hf_config.vocab_size, bias=False)
        self._packed_tied_head: PackedWeight | None = None

    @staticmethod
    def bias_flags(hf_config: PretrainedConfig) -> tuple[bool, bool, bool]:
        """Whether (q/k/v, o, MLP) projections carry biases; Llama states it in the config."""
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        return attention_bias, attention_bias, bool(getattr(hf_config, "mlp_bias", False))

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Final-normed hidden states ``[T, hidden]`` for the flat batch of ``T`` new tokens."""
        if len(kv_caches) != self.num_layers:
            raise ValueError(f"expected one KV cache per layer ({self.num_layers}), got {len(kv_caches)}.")
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits ``[N, vocab]`` in float32 for the rows of ``hidden`` that need them."""
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        return linear(hidden, self.model.embed_tokens.weight, None, self._packed_tied_head).float()

    def pack_weights(self, max_extra_bytes: int) -> int:
        """Packs projection weights for the small-batch CPU kernel, the vocabulary head first (the
        largest gain per byte), then layer by layer, while the copies fit in ``max_extra_bytes``.
        Returns the bytes used; 0 off the CPU or for dtypes other than float32. Small batches go
        to the packed copies up to the kernels' default row limits until :meth:`use_cpu_tuning`
        gives this machine's."""
        used = 0
        if self.lm_head is None:
            packed = pack_weight(self.model.embed_tokens.weight)
            if packed is None:
                return 0
            if packed.nbytes <= max_extra_bytes:
                self._packed_tied_head, used = packed, packed.nbytes
        heads = [self.lm_head] if self.lm_head is not None else []
        for module in heads + [m for m in self.model.modules() if isinstance(m, Linear)]:
            added = module.pack()
            if added == 0 or used + added > max_extra_bytes:
                module.packed = None
                break
            used += added
        return used

    def use_cpu_tuning(self, tuning: CpuTuning) -> None:
        """Takes the packed matmul's row limits measured on this machine (by weight format)."""
        for _, packed in self.packed_weights():
            packed.use_cpu_tuning(tuning)

    def packed_weights(self) -> list[tuple[torch.Tensor, PackedWeight]]:
        """``(weight, packed copy)`` of every packed projection, the vocabulary head first."""
        pairs = []
        if self._packed_tied_head is not None:
            pairs.append((self.model.embed_tokens.weight, self._packed_tied_head))
        heads = [self.lm_head] if self.lm_head is not None else []
        for module in heads + [m for m in self.model.modules() if isinstance(m, Linear)]:
            if module.packed is not None:
                pairs.append((module.weight, module.packed))
        return pairs

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy Hugging Face-named tensors into this model, stacking the fused projections.

        Returns the names of the parameters that were filled. Raises ValueError on an unknown
        name, a shape mismatch, or a parameter the checkpoint never provided.
        """
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        fused_shards: dict[str, set[str]] = {}
        for fused, _, shard in _STACKED_PROJECTIONS:
            fused_shards.setdefault(fused, set()).add(shard)
        # Every (parameter, shard) pair must be written once; shard None means the whole tensor.
        expected: set[tuple[str, str | None]] = set()
        for param_name in params:
            shards = fused_shards.get(param_name.rsplit(".", 2)[-2])
            expected |= {(param_name, s) for s in shards} if shards else {(param_name, None)}
        filled: set[tuple[str, str | None]] = set()
        for name, tensor in weights:
            if name.endswith(_IGNORED_WEIGHT_SUFFIXES):
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: some checkpoints still store a copy of the embeddings
            target, shard = name, None
            for fused, part, part_shard in _STACKED_PROJECTIONS:
                if f".{part}." in name:
                    target, shard = name.replace(f".{part}.", f".{fused}."), part_shard
                    break
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint weight {name!r} has no matching parameter in {type(self).__name__}.")
            dest = param.data
            if shard is not None:
                # The owning attention/MLP module knows where this projection's rows sit.
                offset, num_rows = modules[target.rsplit(".", 2)[0]].shard_range(shard)
                dest = dest.narrow(0, offset, num_rows)
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ValueError(f"checkpoint weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}.")
            dest.copy_(tensor)
            filled.add((target, shard))
        missing = sorted(f"{n}[{s}]" if s else n for n, s in expected - filled)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
        return {n for n, _ in filled}


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral is Llama without biases; sliding windows are handled by capping the context length."""

    @staticmethod
    def bias_flags(hf_config: PretrainedConfig) -> tuple[bool, bool, bool]:
        return False, False, False


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 is Llama with biases on the q/k/v projections only."""

    @staticmethod
    def bias_flags(hf_config: PretrainedConfig) -> tuple[bool, bool, bool]:
        return True, False, False
