"""LFM2's gated short convolution against transformers' Lfm2ShortConv in float32: several sequences
in one flat batch, each continued from its state slot (a prefill in two chunks, then decode steps),
against transformers on each whole sequence; and a state saved mid-chunk (a prefix-cache checkpoint)
that another sequence resumes from."""
from __future__ import annotations

import pytest
import torch
from state_layer_utils import Chunk, run_chunk_plan, state_metadata
from transformers import Lfm2Config
from transformers.models.lfm2.modeling_lfm2 import Lfm2ShortConv

from pagellm.layers.short_conv import ShortConv

HIDDEN, L_CACHE = 32, 4


def _layers(bias: bool) -> tuple[Lfm2ShortConv, ShortConv]:
    config = Lfm2Config(hidden_size=HIDDEN, conv_L_cache=L_CACHE, conv_bias=bias, num_hidden_layers=1, layer_types=["conv"])
    torch.manual_seed(0)
    ref = Lfm2ShortConv(config, 0).eval()
    with torch.no_grad():
        for param in ref.parameters():
            param.normal_(0.0, 0.3)
    ours = ShortConv(HIDDEN, L_CACHE, bias)
    for name, tensor in ref.state_dict().items():
        owner, _, kind = name.rpartition(".")
        getattr(ours, owner).load_checkpoint_tensor(kind, None, tensor.clone())
    for module in (ours.in_proj, ours.out_proj):
        module.process_weights_after_loading()
    assert ours.conv.missing_weights() == [] and not ours.in_proj.missing_bias_shards
    return ref, ours


def _step(ours: ShortConv, state: torch.Tensor, hidden: torch.Tensor, chunks: list[Chunk], checkpoints=()) -> torch.Tensor:
    with torch.no_grad():
        return ours(hidden, None, (state,), state_metadata(chunks, checkpoints))


def _state(num_slots: int) -> torch.Tensor:
    return torch.full((num_slots, L_CACHE - 1, HIDDEN), float("nan"))  # an unused slot read shows as NaN


@pytest.mark.parametrize("bias", [False, True])
def test_matches_transformers_across_chunks_and_decode(bias: bool) -> None:
    ref, ours = _layers(bias)
    lengths = [14, 2, 11]  # one shorter than the convolution's reach in its first chunk
    torch.manual_seed(1)
    sequences = [torch.randn(n, HIDDEN) for n in lengths]
    with torch.no_grad():
        expected = [ref(s[None])[0] for s in sequences]
    state = _state(5)
    plan = [[5, 1, 2], [6, 0, 6], [1, 1, 1], [1, 0, 1], [1, 0, 1]]  # two prefill chunks, then decode steps
    got = run_chunk_plan(lambda rows, chunks: _step(ours, state, rows, chunks), sequences, [3, 1, 2], plan)
    for i in range(3):
        torch.testing.assert_close(got[i], expected[i], rtol=1e-5, atol=1e-5)


def test_checkpoint_saved_mid_chunk_resumes_another_sequence() -> None:
    ref, ours = _layers(bias=True)
    torch.manual_seed(2)
    stem, tail_a, tail_b = torch.randn(9, HIDDEN), torch.randn(4, HIDDEN), torch.randn(5, HIDDEN)
    state = _state(4)
    # Sequence A runs stem + tail_a in one chunk and saves its state after the stem into slot 3.
    _step(ours, state, torch.cat([stem, tail_a]), [(0, 13, False)], checkpoints=[(0, 9, 3)])
    state[1] = state[3]  # what the engine does on a prefix hit: the checkpoint into the live slot
    got = _step(ours, state, tail_b, [(1, 5, True)])
    with torch.no_grad():
        expected = ref(torch.cat([stem, tail_b])[None])[0, 9:]
        b, _, x = ref.in_proj(tail_b).chunk(3, dim=-1)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state[1], (b * x)[-(L_CACHE - 1) :])  # the slot holds the convolution's last inputs
