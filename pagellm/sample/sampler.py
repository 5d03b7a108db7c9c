"""The sampler: turns one step's logits into next tokens (and logprobs), vectorized over rows.

Order, as vLLM v1: raw logprobs first (before any processing), then logit bias, banned tokens
and penalties (these can change the argmax, so they apply to greedy rows too), then greedy
argmax for greedy rows; random rows go on through temperature, top-k, top-p, min-p and an
inverse-CDF draw.
"""
from __future__ import annotations

from typing import Optional

import torch

from pagellm.kernels import ops
from pagellm.sample.logprobs import gather_logprobs
from pagellm.sample.metadata import SamplerOutput, SamplingMetadata
from pagellm.sample.penalties import apply_bad_token_ids, apply_logit_bias, apply_penalties
from pagellm.sample.topk_topp import apply_min_p, apply_top_k_top_p

_SAMPLING_EPS = 1e-5
_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def derive_step_seed(seed: int, step: int) -> int:
    """The generator seed for a request's ``step``-th output token: a hash of (seed, step).

    Hashing (rather than advancing one generator per request) makes the draw a pure function of
    the request and its position, so it survives preemption and recomputation. The result fits
    in 64 bits, and its low 32 bits are well mixed too (the CPU generator only uses those).
    """
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (step & _MASK64))


class Sampler:
    """Stateless apart from a pool of reusable ``torch.Generator`` objects for seeded rows."""

    def __init__(self) -> None:
        self._generators: dict[torch.device, list[torch.Generator]] = {}

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        if logits.dim() != 2:
            raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}.")
        num_rows = logits.shape[0]
        if metadata.temperature.shape != (num_rows,) or metadata.greedy_mask.shape != (num_rows,):
            raise ValueError(f"sampling metadata does not describe {num_rows} rows.")
        # The torch path below edits logits in place; the caller's tensor must survive (it retries
        # row by row if this raises), so it gets a copy unless nothing edits it: no bias, bans or
        # penalties, and random rows going through the C++ kernel (which only reads).
        logits, raw_logprobs = self.prepare_logits(logits, metadata, copy=not _use_sampling_kernel(logits))
        if metadata.all_greedy:
            sampled = ops.argmax_rows(logits)
        else:
            greedy = None if metadata.all_random else ops.argmax_rows(logits)
            sampled = self._random_sample(logits, metadata)
            if greedy is not None:
                sampled = torch.where(metadata.greedy_mask.to(logits.device), greedy, sampled)

        logprobs = None
        if raw_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, metadata.max_num_logprobs, sampled)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    @staticmethod
    def prepare_logits(
        logits: torch.Tensor, metadata: SamplingMetadata, copy: bool = True
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """float32 logits with bias, banned tokens and penalties applied (greedy rows' argmax is
        taken from these), and the raw logprobs when any row wants logprobs. The input is copied
        if anything edits it or ``copy``."""
        penalties = (metadata.presence_penalties, metadata.frequency_penalties, metadata.repetition_penalties)
        edits_in_place = bool(metadata.logit_bias or metadata.bad_token_ids) or any(p is not None for p in penalties)
        logits = logits.to(torch.float32, copy=edits_in_place or copy)
        raw_logprobs: Optional[torch.Tensor] = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        apply_logit_bias(logits, metadata.logit_bias)
        apply_bad_token_ids(logits, metadata.bad_token_ids)
        if any(p is not None for p in penalties):
            logits = apply_penalties(
                logits,
                metadata.prompt_token_ids,
                metadata.output_token_ids,
                metadata.presence_penalties,
                metadata.frequency_penalties,
                metadata.repetition_penalties,
            )
        return logits, raw_logprobs

    @staticmethod
    def probs(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """What a random row samples from: softmax after temperature, top-k, top-p and min-p
        (edits ``logits``). Greedy rows get temperature 1; their result is not meant to be used."""
        temperature = metadata.temperature.to(device=logits.device, dtype=logits.dtype)
        temperature = torch.where(temperature < _SAMPLING_EPS, 1.0, temperature)
        logits.div_(temperature.unsqueeze(1))
        logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
        if metadata.min_p is not None:
            logits = apply_min_p(logits, metadata.min_p)
        return logits.softmax(dim=-1)

    def _random_sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Samples every row as random (greedy rows' results are discarded by the caller).

        Rows without top-k, top-p or min-p go through the C++ kernel on CPU, the others (and all
        rows elsewhere) through torch; which path a row takes depends only on its own settings,
        so a seeded row samples the same whatever shares its batch.
        """
        u = self.uniforms(logits.shape[0], metadata.seeds, logits.device, dtype=logits.dtype)
        temperature = metadata.temperature.to(device=logits.device, dtype=logits.dtype)
        if not _use_sampling_kernel(logits):
            return self._torch_sample(logits, temperature, metadata.top_k, metadata.top_p, metadata.min_p, u)
        filtered = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
        if metadata.top_k is not None:
            filtered |= metadata.top_k > 0
        if metadata.top_p is not None:
            filtered |= metadata.top_p < 1.0
        if metadata.min_p is not None:
            filtered |= metadata.min_p > 0.0
        sampled = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
        if not bool(filtered.any()):
            ops.sample_from_logits(sampled, logits, temperature.contiguous(), u.view(-1).contiguous())
            return sampled
        plain = (~filtered).nonzero().squeeze(1)
        rows = filtered.nonzero().squeeze(1)
        if plain.numel():
            out = torch.empty(plain.numel(), dtype=torch.int64, device=logits.device)
            ops.sample_from_logits(out, logits[plain], temperature[plain], u[plain].view(-1))
            sampled[plain] = out
        # Indexing copies, so the torch path's in-place edits never reach the caller's logits.
        sampled[rows] = self._torch_sample(
            logits[rows],
            temperature[rows],
            None if metadata.top_k is None else metadata.top_k[rows],
            None if metadata.top_p is None else metadata.top_p[rows],
            None if metadata.min_p is None else metadata.min_p[rows],
            u[rows],
        )
        return sampled

    def _torch_sample(
        self,
        logits: torch.Tensor,
        temperature: torch.Tensor,
        top_k: Optional[torch.Tensor],
        top_p: Optional[torch.Tensor],
        min_p: Optional[torch.Tensor],
        u: torch.Tensor,
    ) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p, softmax and the inverse-CDF draw at ``u``; edits ``logits``."""
        temperature = torch.where(temperature < _SAMPLING_EPS, 1.0, temperature)
        logits.div_(temperature.unsqueeze(1))
        logits = apply_top_k_top_p(logits, top_k, top_p)
        if min_p is not None:
            logits = apply_min_p(logits, min_p)
        cdf = logits.softmax(dim=-1).cumsum_(dim=-1)
        targets = u * cdf[:, -1:]
        sampled = torch.searchsorted(cdf, targets, right=True).squeeze(1)
        return sampled.clamp_max_(logits.shape[1] - 1)

    def uniforms(
        self,
        num_rows: int,
        seeds: dict[int, tuple[int, int]],
        device: torch.device,
        num_draws: int = 1,
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """``num_draws`` uniform draws per row, ``[num_rows, num_draws]``: the plain sampler takes
        one, the point at which its CDF is inverted (one random number per row; an exponential
        race needs one per vocabulary entry, which costs far more on a CPU: docs/kernels.md); the
        rejection sampler two.

        Seeded rows draw theirs from a generator seeded by (seed, step) alone, so their samples
        do not depend on the other rows of the batch nor on the row's position in it.
        """
        u = torch.rand(num_rows, num_draws, device=device, dtype=dtype)
        for i, (row, (seed, step)) in enumerate(seeds.items()):
            if not 0 <= row < num_rows:
                raise ValueError(f"seeded row {row} is outside the batch of {num_rows} rows.")
            generator = self._generator(device, i)
            generator.manual_seed(derive_step_seed(seed, step))
            u[row] = torch.rand(num_draws, device=device, dtype=dtype, generator=generator)
        return u

    def _generator(self, device: torch.device, index: int) -> torch.Generator:
        pool = self._generators.setdefault(device, [])
        while len(pool) <= index:
            pool.append(torch.Generator(device=device))
        return pool[index]


def _use_sampling_kernel(logits: torch.Tensor) -> bool:
    return logits.dim() == 2 and ops.supports(logits)
