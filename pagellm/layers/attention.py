"""The attention layer models share: fused q/k/v projection, optional per-head q/k norm, rotary
embedding, the paged attention backend with this layer's options, and the output projection.

What varies between architectures is plain data (:class:`AttentionSpec`), so a model file states
its attention in a few lines. Under tensor parallelism the layer holds a contiguous run of KV
heads and the query heads that read them (column-parallel q/k/v) and the matching input columns of
``o_proj`` (row-parallel, one all-reduce).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from pagellm.attention.backend import AttentionBackend, AttentionMetadata, AttentionOptions
from pagellm.attention.kv_quant import KVScales
from pagellm.attention.validation import check_attention_options
from pagellm.distributed.partition import TPShard
from pagellm.layers.linear import Linear, TPSplit, narrow
from pagellm.layers.norm import RMSNorm
from pagellm.layers.rotary import RotaryArgs, apply_rotary, rotate_in_place


@dataclass(frozen=True)
class AttentionSpec:
    """One layer's attention, all heads counted (the layer takes its rank's share)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    qkv_bias: bool = False
    o_bias: bool = False
    # Per-head RMSNorm of q and k before rotary (Qwen3, Gemma 3): its eps and weight offset.
    qk_norm: bool = False
    qk_norm_eps: float = 1e-6
    qk_norm_offset: float = 0.0
    sliding_window: Optional[int] = None
    logits_soft_cap: Optional[float] = None
    sinks: bool = False  # gpt-oss: one learnt logit per head in every softmax denominator
    # Qwen3-Next / Qwen3.5: q_proj also yields a gate per head (each head's query then its gate),
    # and the attention output is multiplied by its sigmoid before o_proj.
    output_gate: bool = False
    # Gemma 4: values RMS-normalised per head without a weight (``v_norm``, eps ``qk_norm_eps``);
    # ``k_eq_v``: no v projection, the values are the keys' projection before k's norm and rotary.
    v_norm: bool = False
    k_eq_v: bool = False
    # Gemma 4's last layers: attend over another layer's keys and values (its KV cache and its
    # group's metadata are what the layer is handed) with no k/v projection, writing nothing.
    kv_shared: bool = False


class Attention(nn.Module):
    def __init__(self, spec: AttentionSpec, layer_idx: int, attn_backend: AttentionBackend, shard: TPShard) -> None:
        super().__init__()
        if spec.num_heads % spec.num_kv_heads != 0:
            raise ValueError(
                f"num_attention_heads ({spec.num_heads}) must be a multiple of num_key_value_heads ({spec.num_kv_heads})."
            )
        self.layer_idx = layer_idx
        self.attn_backend = attn_backend
        self.shard = shard
        self.num_heads = shard.num_q_heads
        self.num_kv_heads = shard.num_kv_heads
        self.head_dim = d = spec.head_dim
        self.q_size = self.num_heads * d
        self.kv_size = self.num_kv_heads * d
        self.scale = spec.scale
        q_range, kv_range = (shard.q_head_start * d, self.q_size), (shard.kv_head_start * d, self.kv_size)
        self.output_gate = spec.output_gate
        self.kv_shared, self.k_eq_v = spec.kv_shared, spec.k_eq_v
        if spec.kv_shared and (spec.output_gate or not spec.qk_norm):
            raise ValueError("a layer that reads another layer's KV is supported with a q norm and no output gate")
        q_rows = 2 if spec.output_gate else 1  # a gated head's rows are its query's, then its gate's
        kv_shards = () if spec.kv_shared else ("k",) if spec.k_eq_v else ("k", "v")
        self.qkv_proj = Linear(
            spec.hidden_size,
            q_rows * self.q_size + len(kv_shards) * self.kv_size,
            bias=spec.qkv_bias,
            shard_sizes={"q": q_rows * self.q_size, **{s: self.kv_size for s in kv_shards}},
            tp_split=TPSplit(
                0,
                {"q": (q_rows * q_range[0], q_rows * q_range[1]), **{s: kv_range for s in kv_shards}},
                full_sizes={"q": q_rows * spec.num_heads * d, **{s: spec.num_kv_heads * d for s in kv_shards}},
            ),
        )
        self.o_proj = Linear(
            self.q_size, spec.hidden_size, bias=spec.o_bias, tp_split=TPSplit(1, {"": q_range}), reduce_results=True
        )
        self.q_norm = self.k_norm = None
        if spec.qk_norm:
            self.q_norm = RMSNorm(d, spec.qk_norm_eps, spec.qk_norm_offset)
            self.k_norm = None if spec.kv_shared else RMSNorm(d, spec.qk_norm_eps, spec.qk_norm_offset)
        self.v_norm_eps = spec.qk_norm_eps if spec.v_norm else None
        self.sinks = nn.Parameter(torch.zeros(self.num_heads)) if spec.sinks else None
        self.options = AttentionOptions(sliding_window=spec.sliding_window, logits_soft_cap=spec.logits_soft_cap)
        # An 8-bit cache's scales for this layer (pagellm.attention.kv_quant); unused by other caches.
        self.kv_scales = KVScales()

    def load_checkpoint_tensor(self, kind: str, shard: Optional[str], source: torch.Tensor) -> None:
        """The layer's own parameters: gpt-oss's per-head sinks (this rank's query heads)."""
        if kind != "sinks" or self.sinks is None:
            raise ValueError(f"attention has no parameter {kind!r}")
        if self.shard.world_size > 1:
            source = narrow(source, 0, self.shard.q_head_start, self.num_heads)
        self.sinks.data.copy_(source)
        self.options = AttentionOptions(self.options.sliding_window, self.options.logits_soft_cap, self.sinks.data.float())

    def _rotate(self, x: torch.Tensor, num_heads: int, rope: Optional[RotaryArgs]) -> torch.Tensor:
        """``x`` ``[T, heads * head_dim]`` (rows contiguous) rotated: in place where the kernel can
        (``rope`` None: a model without positions in its attention, NoPE, leaves it as it is)."""
        if rope is None:
            return x.view(x.shape[0], num_heads, self.head_dim)
        if rope.fused:
            rotate_in_place(x, rope.positions, rope.cos, rope.sin, num_heads, self.head_dim)
            return x.view(x.shape[0], num_heads, self.head_dim)
        return apply_rotary(x.view(x.shape[0], num_heads, self.head_dim), rope.cos, rope.sin)

    def _attend_cached(self, query: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: AttentionMetadata) -> torch.Tensor:
        """Attention over the keys and values another layer wrote this step (``kv_shared``); its
        scales are this layer's (the model hands the source's :class:`KVScales` over)."""
        backend = self.attn_backend
        options = check_attention_options(None if self.options.plain else self.options, query)
        backend.check_supported(query, kv_cache)
        return backend.attend(query, kv_cache, attn_metadata, self.scale, self.kv_scales, options)

    def _norm_values(self, v: torch.Tensor) -> torch.Tensor:
        """Each value head RMS-normalised without a weight, in float32 as transformers does it."""
        x = v.float()
        return (x * torch.pow(x.pow(2).mean(-1, keepdim=True) + self.v_norm_eps, -0.5)).to(v.dtype)

    def forward(
        self, hidden: torch.Tensor, rope: Optional[RotaryArgs], kv_cache: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        gate = None
        if self.kv_shared:
            q = self._rotate(self.q_norm.norm_heads(qkv.view(num_tokens, self.num_heads, self.head_dim)), self.num_heads, rope)
            out = self._attend_cached(q.contiguous(), kv_cache, attn_metadata).reshape(num_tokens, self.q_size)
            return self.o_proj(out)
        if self.k_eq_v:
            # The values are the keys' projection as it comes out: nothing may rotate it in place.
            q, k = qkv.split([self.q_size, self.kv_size], dim=-1)
            v = k
        elif self.output_gate:
            q_gate, k, v = qkv.split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
            q_gate = q_gate.view(num_tokens, self.num_heads, 2 * self.head_dim)
            q, gate = q_gate[..., : self.head_dim].reshape(num_tokens, self.q_size), q_gate[..., self.head_dim :]
        else:
            if self.q_norm is None and rope is not None and rope.fused:
                # q and k are rotated where they lie: all three stay views of one buffer, no copies.
                rotate_in_place(qkv, rope.positions, rope.cos, rope.sin, self.num_heads + self.num_kv_heads, self.head_dim)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        shape_q, shape_kv = (num_tokens, self.num_heads, self.head_dim), (num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self._rotate(self.q_norm.norm_heads(q.view(shape_q)), self.num_heads, rope)
            k = self._rotate(self.k_norm.norm_heads(k.view(shape_kv)), self.num_kv_heads, rope)
        elif rope is None or (rope.fused and gate is None):
            q, k = q.view(shape_q), k.view(shape_kv)
        else:
            q, k = apply_rotary(q.view(shape_q), rope.cos, rope.sin), apply_rotary(k.view(shape_kv), rope.cos, rope.sin)
        v = v.view(shape_kv)
        if self.v_norm_eps is not None:
            v = self._norm_values(v)
        if not self.attn_backend.accepts_strided_qkv:
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        if self.kv_scales.calculate and num_tokens > 0:
            self.kv_scales.measure(k, v)
        if self.options.plain:
            out = self.attn_backend.forward(q, k, v, kv_cache, attn_metadata, self.scale, self.kv_scales)
        else:
            out = self.attn_backend.forward(q, k, v, kv_cache, attn_metadata, self.scale, self.kv_scales, options=self.options)
        out = out.reshape(num_tokens, self.q_size)
        if gate is not None:
            out = out * torch.sigmoid(gate.reshape(num_tokens, self.q_size))
        return self.o_proj(out)
