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
from pagellm.attention.kv_quant import KVScales
from pagellm.config import EXACT_LINEAR, LinearPrecision
from pagellm.distributed.parallel_state import get_tp_group
from pagellm.distributed.partition import TPShard
from pagellm.kernels import ops
from pagellm.kernels.tuning import CpuTuning
from pagellm.models.gguf_types import GGUFWeight
from pagellm.models.layers import Linear, RMSNorm, SiluAndMulLinear, VocabParallelEmbedding, narrow, pad_rows, rotate_in_place
from pagellm.models.linear_method import DenseMethod, WeightSource
from pagellm.models.rope import RotaryArgs, RotaryEmbedding, apply_rotary, head_dim_of

# (fused parameter, checkpoint projection, shard) for the projections we stack at load time.
_STACKED_PROJECTIONS = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", "gate"),
    ("gate_up_proj", "up_proj", "up"),
)


def tp_shard_of(hf_config: PretrainedConfig) -> TPShard:
    """This process's slice of the model under its tensor-parallel group (all of it without one)."""
    tp = get_tp_group()
    num_heads = hf_config.num_attention_heads
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    return TPShard.of(tp.rank, tp.world_size, num_heads, num_kv_heads, hf_config.intermediate_size, hf_config.vocab_size)


# Buffers some checkpoints carry that we compute ourselves instead.
_IGNORED_WEIGHT_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
# An fp8 checkpoint's KV cache scales, as its quantizer names them (compressed-tensors, AutoFP8's
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
        total_heads = hf_config.num_attention_heads
        total_kv_heads = getattr(hf_config, "num_key_value_heads", None) or total_heads
        if total_heads % total_kv_heads != 0:
            raise ValueError(
                f"num_attention_heads ({total_heads}) must be a multiple of num_key_value_heads ({total_kv_heads})."
            )
        # Under tensor parallelism: this rank's KV heads and the query heads that read them
        # (column-parallel q/k/v), and the matching input columns of o_proj (row-parallel).
        self.tp = get_tp_group()
        self.shard = tp_shard_of(hf_config)
        self.num_heads = self.shard.num_q_heads
        self.num_kv_heads = self.shard.num_kv_heads
        self.head_dim = head_dim_of(hf_config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = Linear(
            hf_config.hidden_size,
            self.q_size + 2 * self.kv_size,
            bias=qkv_bias,
            shard_sizes={"q": self.q_size, "k": self.kv_size, "v": self.kv_size},
        )
        self.o_proj = Linear(self.q_size, hf_config.hidden_size, bias=o_bias)
        # An fp8 cache's scales for this layer (pagellm.attention.kv_quant); unused by other caches.
        self.kv_scales = KVScales()

    def tp_source_range(self, shard: str) -> tuple[int, int]:
        """(offset, length) of this rank's part of a checkpoint projection: rows of q/k/v, columns of o."""
        d = self.head_dim
        if shard in ("q", "o"):
            return self.shard.q_head_start * d, self.q_size
        return self.shard.kv_head_start * d, self.kv_size

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
        if self.kv_scales.calculate and num_tokens > 0:
            self.kv_scales.measure(k, v)
        out = self.attn_backend.forward(q, k, v, kv_cache, attn_metadata, self.scale, self.kv_scales)
        return self.tp.all_reduce(self.o_proj(out.reshape(num_tokens, self.q_size)))


class LlamaMLP(nn.Module):
    def __init__(self, hf_config: PretrainedConfig, bias: bool) -> None:
        super().__init__()
        act = getattr(hf_config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {act!r} is not supported; Llama-family models here use 'silu'.")
        # Column-parallel gate/up, row-parallel down: one all-reduce after down under TP.
        self.tp = get_tp_group()
        self.shard = tp_shard_of(hf_config)
        self.intermediate_size = self.shard.inter_size
        # Returns silu(gate) * up directly (the activation fused into the projection's kernel).
        self.gate_up_proj = SiluAndMulLinear(
            hf_config.hidden_size,
            2 * self.intermediate_size,
            bias=bias,
            shard_sizes={"gate": self.intermediate_size, "up": self.intermediate_size},
        )
        self.down_proj = Linear(self.intermediate_size, hf_config.hidden_size, bias=bias)

    def tp_source_range(self, shard: str) -> tuple[int, int]:
        """(offset, length) of this rank's part of a checkpoint projection: rows of gate/up, columns of down."""
        return self.shard.inter_start, self.intermediate_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(self.gate_up_proj(x)))


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
        tp, shard = get_tp_group(), tp_shard_of(hf_config)
        rows = hf_config.vocab_size if tp.world_size == 1 else shard.vocab_padded
        self.embed_tokens = VocabParallelEmbedding(rows, hf_config.hidden_size, shard.vocab_start, shard.vocab_size)
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
        self.tp = get_tp_group()
        self.shard = tp_shard_of(hf_config)
        self.vocab_size = hf_config.vocab_size
        qkv_bias, o_bias, mlp_bias = self.bias_flags(hf_config)
        self.model = LlamaModel(hf_config, attn_backend, qkv_bias, o_bias, mlp_bias)
        # Tied models reuse the embedding matrix directly rather than carrying an alias module.
        head_rows = hf_config.vocab_size if self.tp.world_size == 1 else self.shard.vocab_padded
        # Tied models multiply by the embedding rows: the head is built from them after loading.
        self.lm_head = Linear(hf_config.hidden_size, head_rows, bias=False)

    @staticmethod
    def bias_flags(hf_config: PretrainedConfig) -> tuple[bool, bool, bool]:
        """Whether (q/k/v, o, MLP) projections carry biases; Llama states it in the config."""
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        return attention_bias, attention_bias, bool(getattr(hf_config, "mlp_bias", False))

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    def kv_scales(self) -> list[KVScales]:
        """Each layer's KV cache scales, in layer order."""
        return [layer.self_attn.kv_scales for layer in self.model.layers]

    def _load_kv_scale(self, name: str, tensor: WeightSource) -> bool:
        """Takes a checkpoint's KV cache scale if ``name`` is one; returns whether it was."""
        for suffix, which in _KV_SCALE_SUFFIXES.items():
            if name.endswith(suffix) and name.startswith("model.layers."):
                layer = int(name.removeprefix("model.layers.").partition(".")[0])
                value = tensor.dequantize() if isinstance(tensor, GGUFWeight) else tensor
                if value.numel() != 1:
                    raise ValueError(f"checkpoint KV cache scale {name!r} must hold one number, not {tuple(value.shape)}")
                scales = self.model.layers[layer].self_attn.kv_scales
                scale = float(value.float().reshape(()))
                scales.set(scale if "k" in which else scales.k_scale, scale if "v" in which else scales.v_scale)
                return True
        return False

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
        logits = self.lm_head(hidden)
        if self.tp.world_size > 1:
            # Vocab-parallel head: each rank's rows of the vocabulary, gathered in rank order.
            logits = self.tp.all_gather(logits, dim=-1)[:, : self.vocab_size]
        return logits.float()

    def linear_layers(self) -> list[tuple[str, Linear]]:
        """Every linear layer by name, the vocabulary head first."""
        return [("lm_head", self.lm_head)] + [(n, m) for n, m in self.model.named_modules(prefix="model") if isinstance(m, Linear)]

    def finish_loading(self, precision: LinearPrecision, device: torch.device | str, dtype: torch.dtype) -> None:
        """After every tensor is in: a tied head is built from the embedding rows, and the
        embedding moves to ``device`` off the CPU."""
        embed = self.model.embed_tokens
        embed.process_weights_after_loading(device, dtype, precision)
        if not self.tie_word_embeddings:
            return
        if embed.packed is not None:  # one copy of the table: the head multiplies by its panels
            self.lm_head.method = embed.packed
            return
        self.lm_head.load_shard(None, embed.source_rows(self.lm_head.out_features))
        self.lm_head.process_weights_after_loading(precision, device, dtype)

    def weight_bytes(self) -> int:
        """Bytes the model's weights hold, every form counted once."""
        linear = sum(layer.method.nbytes for _, layer in self.linear_layers() if layer.method is not None)
        embed = self.model.embed_tokens
        dense_head = getattr(self.lm_head.method, "weight", None)
        shared = (dense_head is not None and embed.dense is dense_head) or (
            embed.packed is not None and embed.packed is self.lm_head.method
        )
        embed_bytes = 0 if shared else embed.nbytes
        return linear + embed_bytes + sum(p.numel() * p.element_size() for p in self.parameters())

    def use_cpu_tuning(self, tuning: CpuTuning) -> None:
        """Takes the limits measured on this machine (the float32 panels' crossover to BLAS)."""
        for _, layer in self.linear_layers():
            layer.use_cpu_tuning(tuning)

    def packed_weights(self) -> list[tuple[torch.Tensor, DenseMethod]]:
        """``(weight, method)`` of every layer held as float32 panels (the form whose row limit
        :func:`pagellm.kernels.tuning.measure_cpu_tuning` measures), the vocabulary head first."""
        pairs = []
        for _, layer in self.linear_layers():
            method = layer.method
            if isinstance(method, DenseMethod) and method.panels is not None and not method.fused_silu_mul:
                pairs.append((method.weight, method))
        return pairs

    def load_weights(
        self,
        weights: Iterable[tuple[str, WeightSource]],
        precision: LinearPrecision = EXACT_LINEAR,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> set[str]:
        """Takes Hugging Face-named tensors as stored: projections into their layer's shard (this
        rank's part under tensor parallelism), the rest copied into parameters. A linear layer is
        processed into its method for ``precision`` as soon as all its shards are in, so only one
        layer's tensors as stored are held at a time beside the model.

        Returns the names that were filled. Raises ValueError on an unknown name, a shape
        mismatch, or a weight the checkpoint never provided.
        """
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        filled: set[str] = set()
        # Every parameter (a fused projection's bias: each of its shards) must be written once.
        expected: set[tuple[str, str | None]] = set()
        for param_name in params:
            owner = modules.get(param_name.rpartition(".")[0])
            shards = list(owner.shard_sizes) if isinstance(owner, Linear) and len(owner.shard_sizes) > 1 else [None]
            expected |= {(param_name, s) for s in shards}
        written: set[tuple[str, str | None]] = set()
        for name, tensor in weights:
            if name.endswith(_IGNORED_WEIGHT_SUFFIXES) or self._load_kv_scale(name, tensor):
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue  # tied: some checkpoints still store a copy of the embeddings
            target, shard = name, None
            for fused, part, part_shard in _STACKED_PROJECTIONS:
                if f".{part}." in name:
                    target, shard = name.replace(f".{part}.", f".{fused}."), part_shard
                    break
            owner_name, _, kind = target.rpartition(".")
            owner = modules.get(owner_name)
            if self.tp.world_size > 1:
                tensor = self._tp_slice(target, shard, tensor, modules)
            if isinstance(owner, Linear) and kind == "weight":
                try:
                    owner.load_shard(shard, tensor)
                except ValueError as e:
                    raise ValueError(f"checkpoint weight {name!r}: {e}") from None
                del tensor
                if not owner.missing_shards:
                    owner.process_weights_after_loading(precision, device, dtype)
            elif isinstance(owner, VocabParallelEmbedding) and kind == "weight":
                owner.load(tensor)
            else:
                param = params.get(target)
                if param is None:
                    raise ValueError(f"checkpoint weight {name!r} has no matching parameter in {type(self).__name__}.")
                dense = tensor.dequantize() if isinstance(tensor, GGUFWeight) else tensor
                dest = param.data
                if isinstance(owner, Linear) and shard is not None:  # a fused projection's bias
                    dest = dest.narrow(0, *owner.shard_range(shard))
                if self.tp.world_size > 1 and target.endswith("lm_head.bias"):
                    dest.zero_()
                    dest = dest.narrow(0, 0, dense.shape[0])
                if tuple(dest.shape) != tuple(dense.shape):
                    raise ValueError(f"checkpoint weight {name!r} has shape {tuple(dense.shape)}, expected {tuple(dest.shape)}.")
                dest.copy_(dense)
                written.add((target, shard))
            filled.add(target)
        missing = [
            f"{n}.weight[{s}]" if s else f"{n}.weight"
            for n, layer in self.linear_layers()
            if not (n == "lm_head" and self.tie_word_embeddings)
            for s in layer.missing_shards
        ]
        if not self.model.embed_tokens.loaded:
            missing.append("model.embed_tokens.weight")
        missing += sorted(f"{n}[{s}]" if s else n for n, s in expected - written)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
        self.finish_loading(precision, device, dtype)
        return filled

    def _tp_slice(self, target: str, shard: str | None, tensor: WeightSource, modules: dict[str, nn.Module]) -> WeightSource:
        """This rank's part of checkpoint tensor ``tensor`` for parameter ``target``."""
        parts = target.rsplit(".", 2)
        owner, proj, kind = (modules.get(parts[0]), parts[1], parts[2]) if len(parts) == 3 else (None, "", "")
        if target.endswith(("embed_tokens.weight", "lm_head.weight", "lm_head.bias")):
            # Vocabulary rows; the padding rows past the real vocabulary are zero.
            rows = narrow(tensor, 0, self.shard.vocab_start, self.shard.vocab_size)
            if target.endswith("lm_head.weight"):
                return pad_rows(rows, self.shard.vocab_padded)
            return rows
        if shard is not None:  # column-parallel q/k/v, gate/up: this rank's output rows
            offset, length = owner.tp_source_range(shard)
            return narrow(tensor, 0, offset, length)
        if proj in ("o_proj", "down_proj"):  # row-parallel: input columns; the bias is added once
            if kind == "bias":
                return tensor if self.tp.rank == 0 else torch.zeros_like(tensor)
            offset, length = owner.tp_source_range("o" if proj == "o_proj" else "down")
            return narrow(tensor, 1, offset, length)
        return tensor  # norms: replicated


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
