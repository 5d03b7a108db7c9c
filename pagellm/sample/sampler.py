"""The sampler: turns one step's logits into next tokens (and logprobs), vectorized over rows.

Order, as vLLM v1: raw logprobs first (before any processing), then logit bias, banned tokens
and penalties (these can change the argmax, so they apply to greedy rows too), then greedy
argmax for greedy rows; random rows go on through temperature, top-k, top-p, min-p and an
inverse-CDF draw.
"""
from __future__ import annotations

from typing import Optional

import torch

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
        # Our own float32 copy: every later step works in place without touching the caller's.
        logits = logits.to(torch.float32, copy=True)
        raw_logprobs: Optional[torch.Tensor] = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)

        apply_logit_bias(logits, metadata.logit_bias)
        apply_bad_token_ids(logits, metadata.bad_token_ids)
        if (
            metadata.presence_penalties is not None
            or metadata.frequency_penalties is not None
            or metadata.repetition_penalties is not None
        ):
            logits = apply_penalties(
                logits,
                metadata.prompt_token_ids,
                metadata.output_token_ids,
                metadata.presence_penalties,
                metadata.frequency_penalties,
                metadata.repetition_penalties,
            )

        if metadata.all_greedy:
            sampled = logits.argmax(dim=-1)
        else:
            greedy = None if metadata.all_random else logits.argmax(dim=-1)
            sampled = self._random_sample(logits, metadata)
            if greedy is not None:
                sampled = torch.where(metadata.greedy_mask.to(logits.device), greedy, sampled)

        logprobs = None
        if raw_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, metadata.max_num_logprobs, sampled)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    def _random_sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Samples every row as random (greedy rows' results are discarded by the caller)."""
        temperature = metadata.temperature.to(device=logits.device, dtype=logits.dtype)
        # Greedy rows may carry temperature 0; keep their arithmetic finite.
        temperature = torch.where(temperature < _SAMPLING_EPS, 1.0, temperature)
        logits.div_(temperature.unsqueeze(1))
        logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
        if metadata.min_p is not None:
            logits = apply_min_p(logits, metadata.min_p)
        probs = logits.softmax(dim=-1)
        return self._inverse_cdf_sample(probs, metadata.seeds)

    def _inverse_cdf_sample(self, probs: torch.Tensor, seeds: dict[int, tuple[int, int]]) -> torch.Tensor:
        """Draws one token per row by inverting its CDF at a uniform draw: one random number
        per row (an exponential race needs one per vocabulary entry, ~10x slower on a CPU).

        Seeded rows draw their uniform from a generator seeded by (seed, step) alone, so their
        samples do not depend on the other rows of the batch nor on the row's position in it.
        """
        num_rows = probs.shape[0]
        u = torch.rand(num_rows, 1, device=probs.device, dtype=probs.dtype)
        for i, (row, (seed, step)) in enumerate(seeds.items()):
            if not 0 <= row < num_rows:
                raise ValueError(f"seeded row {row} is outside the batch of {num_rows} rows.")
            generator = self._generator(probs.device, i)
            generator.manual_seed(derive_step_seed(seed, step))
            u[row] = torch.rand(1, device=probs.device, dtype=probs.dtype, generator=generator)
        cdf = probs.cumsum_(dim=-1)
        # Scale to the row's total so rounding in the cumsum never leaves u past the end;
        # masked tokens add no mass, so the first index where the CDF exceeds u has p > 0.
        targets = u * cdf[:, -1:]
        sampled = torch.searchsorted(cdf, targets, right=True).squeeze(1)
        return sampled.clamp_max_(probs.shape[1] - 1)

    def _generator(self, device: torch.device, index: int) -> torch.Generator:
        pool = self._generators.setdefault(device, [])
        while len(pool) <= index:
            pool.append(torch.Generator(device=device))
        return pool[index]
