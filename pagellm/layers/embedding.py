"""The vocabulary embedding, split by vocabulary rows under tensor parallelism."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.nn import functional as F

from pagellm.config import EXACT_LINEAR, LinearPrecision
from pagellm.distributed.parallel_state import get_tp_group
from pagellm.kernels import ops
from pagellm.kernels.context import KernelContext
from pagellm.layers.gguf_types import GGUFWeight, dequantize_rows, kernel_takes
from pagellm.layers.linear import narrow, pad_rows
from pagellm.layers.linear_method import GGUFInt8Method, WeightSource


class VocabParallelEmbedding(nn.Module):
    """The embedding table, split by vocabulary rows under tensor parallelism (padded to equal
    pieces): each rank looks up the ids it holds, zeros the others, and one all-reduce sums them.

    A GGUF table stays in its blocks on a CPU and only the looked-up rows are dequantized (by the
    same dequantizer as everything else, so values are exact); a float table stays in its dtype
    and rows are returned as float32. A tied LM head is built from :meth:`source_rows`; when it
    holds the table's own values (int8 panels of its blocks, or bfloat16 panels of a bfloat16
    table) rows are read from the head's panels and the table is not kept twice.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        vocab_start: int = 0,
        vocab_size: Optional[int] = None,
        scale: Optional[float] = None,
    ) -> None:
        super().__init__()
        # Gemma multiplies the looked-up rows by sqrt(hidden), rounded to the activations' dtype.
        self.scale = scale
        self.tp = get_tp_group()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.vocab_start = vocab_start
        self.vocab_size = vocab_size if vocab_size is not None else num_embeddings
        self.dense: Optional[torch.Tensor] = None
        self.blocks: Optional[GGUFWeight] = None
        # On the int8 path the table lives only in the kernel's panels, shared with a tied head.
        self.packed: Optional[GGUFInt8Method] = None
        # A bfloat16 table whose tied head's bfloat16 panels ([panels, k / 2, 32, 2]) hold the same values.
        self.head_panels: Optional[torch.Tensor] = None
        self.out_dtype = torch.float32  # the model's activations' dtype

    @property
    def loaded(self) -> bool:
        return self.dense is not None or self.blocks is not None or self.packed is not None or self.head_panels is not None

    @property
    def weight(self) -> torch.Tensor:
        """The table as float32 ``[rows, dim]`` (dequantized: a copy for a GGUF table)."""
        if self.packed is not None or self.head_panels is not None:
            return self._lookup(torch.arange(self.num_embeddings))
        if self.blocks is not None:
            return pad_rows(self.blocks.dequantize(), self.num_embeddings)
        return self.dense.float()

    def resident_tensors(self) -> list[torch.Tensor]:
        """The tensors the table keeps resident: its int8 panels or a tied head's bfloat16 panels
        (the head's too), its GGUF blocks as stored, or its dense rows (a tied dense head's too)."""
        if self.packed is not None:
            return self.packed.resident_tensors()
        if self.head_panels is not None:
            return [self.head_panels]
        if self.blocks is not None:
            return [self.blocks.stored]  # rows narrowed or padded, never permuted: the blocks' bytes
        return [] if self.dense is None else [self.dense]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.resident_tensors())

    def load_checkpoint_tensor(self, kind: str, shard: Optional[str], source: WeightSource) -> None:
        """Takes the whole checkpoint table; under tensor parallelism this rank's rows are cut here."""
        if kind != "weight" or shard:
            raise ValueError(f"an embedding has no {kind}{f'[{shard}]' if shard else ''}")
        if self.tp.world_size > 1:
            source = narrow(source, 0, self.vocab_start, self.vocab_size)
        self.load(source)

    def load(self, source: WeightSource) -> None:
        """Takes this rank's rows of the table as stored."""
        if source.shape[1] != self.embedding_dim or source.shape[0] > self.num_embeddings:
            raise ValueError(f"embedding has shape {tuple(source.shape)}, expected ({self.num_embeddings}, {self.embedding_dim})")
        if isinstance(source, GGUFWeight):
            self.blocks = source
        else:
            self.dense = pad_rows(source, self.num_embeddings).contiguous()

    def process_weights_after_loading(
        self,
        device: torch.device | str,
        dtype: torch.dtype,
        precision: LinearPrecision = EXACT_LINEAR,
        kernels: Optional[KernelContext] = None,
    ) -> None:
        """Rows come out in ``dtype``; off the CPU the table is dense on ``device`` in it. On the
        int8 path a GGUF table the kernel takes is repacked into its panels (rows padded to the
        table's size, so a tied head can multiply by the very same panels), through ``kernels``
        (the load's :class:`KernelContext`)."""
        self.out_dtype = dtype
        if torch.device(device).type == "cpu":
            if precision.kind == "int8" and self.blocks is not None and kernel_takes(self.blocks.ggml_type):
                self.packed = GGUFInt8Method(self.blocks.pad_rows(self.num_embeddings), kernels=kernels)
                self.blocks = None
            return
        if self.blocks is not None:
            self.dense, self.blocks = pad_rows(self.blocks.dequantize(), self.num_embeddings), None
        self.dense = self.dense.to(device=device, dtype=dtype).contiguous()

    def source_rows(self, rows: int) -> WeightSource:
        """The table as stored, padded to ``rows``, for a tied LM head to pack from."""
        return pad_rows(self.blocks, rows) if self.blocks is not None else pad_rows(self.dense, rows)

    def share_head_panels(self, panels: torch.Tensor) -> bool:
        """Reads rows from a tied head's bfloat16 panels (``ops.pack_weight_bf16`` of this table,
        unfused) and lets the table go, where they hold its very values; whether it did."""
        cols = panels.shape[2] if panels.dim() == 4 else 0
        if (
            self.dense is None
            or self.dense.dtype != torch.bfloat16
            or self.dense.device.type != "cpu"
            or panels.dtype != torch.bfloat16
            or cols == 0
            or panels.shape[0] * cols < self.num_embeddings
            or panels.shape[1] * panels.shape[3] < self.embedding_dim
        ):
            return False
        self.head_panels, self.dense = panels, None
        return True

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.head_panels is not None:
            panels, flat = self.head_panels, ids.cpu().reshape(-1)
            cols = panels.shape[2]
            rows = panels[flat // cols, :, flat % cols, :].reshape(flat.numel(), -1)[:, : self.embedding_dim]
            return rows.to(ids.device, self.out_dtype).view(*ids.shape, self.embedding_dim)
        if self.packed is not None:
            rows = ops.int8_rows(self.packed.packed, int(self.packed.ggml_type), self.embedding_dim, ids.cpu())
            return rows.to(ids.device, self.out_dtype)
        if self.blocks is not None:
            rows = self.blocks.data.index_select(0, ids.cpu().clamp_(0, self.blocks.rows - 1))
            return dequantize_rows(rows, self.blocks.ggml_type, self.embedding_dim).to(ids.device, self.out_dtype)
        return F.embedding(ids, self.dense).to(self.out_dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            out = self._lookup(input_ids)
        else:
            local = input_ids - self.vocab_start
            outside = (local < 0) | (local >= self.vocab_size)
            out = self._lookup(local.masked_fill(outside, 0))
            out.masked_fill_(outside.unsqueeze(-1), 0.0)
            out = self.tp.all_reduce(out)
        if self.scale is not None:
            out.mul_(torch.tensor(self.scale, dtype=out.dtype))
        return out


