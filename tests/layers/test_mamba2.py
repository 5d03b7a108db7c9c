"""The Mamba-2 mixer against transformers' Granite 4.0-H Mamba layer in float32: several sequences
in one flat batch, each then continued from its state slot (a prefill in two chunks, then decode
steps), against transformers on each whole sequence; and its state sizes per tensor-parallel rank."""
from __future__ import annotations

import pytest
import torch
from state_layer_utils import Chunk, run_chunk_plan, state_metadata
from transformers import AutoConfig
from transformers.models.granitemoehybrid.modeling_granitemoehybrid import GraniteMoeHybridMambaLayer

from pagellm.layers.mamba2 import Mamba2Mixer, mamba2_state_shapes

_DIMS = dict(hidden_size=32, mamba_n_heads=8, mamba_d_head=8, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, rms_norm_eps=1e-5)


def _layers(num_groups: int, time_step_limit: tuple[float, float]) -> tuple[GraniteMoeHybridMambaLayer, Mamba2Mixer]:
    config = AutoConfig.for_model(
        "granitemoehybrid", **_DIMS, mamba_n_groups=num_groups, time_step_limit=time_step_limit, num_hidden_layers=1,
        layer_types=["mamba"], num_local_experts=0, mamba_chunk_size=8,
    )
    torch.manual_seed(0)
    ref = GraniteMoeHybridMambaLayer(config, 0).eval()
    with torch.no_grad():
        for name, param in ref.named_parameters():
            param.copy_(1.0 + 0.1 * torch.randn_like(param) if "norm" in name else 0.3 * torch.randn_like(param))
        ref.A_log.copy_(torch.linspace(-1.0, 1.5, ref.num_heads))  # decays from slow to fast
    ours = Mamba2Mixer(32, 8, 8, num_groups, 16, 4, 1e-5, time_step_limit=time_step_limit, chunk_size=8)
    for name, tensor in ref.state_dict().items():
        owner, _, kind = name.rpartition(".")
        (getattr(ours, owner) if owner else ours).load_checkpoint_tensor(kind, None, tensor.clone())
    for module in (ours.in_proj, ours.out_proj):
        module.process_weights_after_loading()
    assert not ours.missing_weights() and not ours.conv1d.missing_weights() and not ours.norm.missing_weights()
    return ref, ours


def _step(ours: Mamba2Mixer, state, hidden: torch.Tensor, chunks: list[Chunk]) -> torch.Tensor:
    with torch.no_grad():
        return ours(hidden, None, state, state_metadata(chunks))


@pytest.mark.parametrize("num_groups,time_step_limit", [(1, (0.0, float("inf"))), (2, (0.0, float("inf"))), (4, (0.05, 0.5))])
def test_mixer_matches_transformers_across_chunks_and_decode(num_groups: int, time_step_limit: tuple[float, float]) -> None:
    ref, ours = _layers(num_groups, time_step_limit)
    lengths = [21, 13, 30]
    torch.manual_seed(1)
    sequences = [torch.randn(n, 32) for n in lengths]
    with torch.no_grad():
        expected = [ref(s[None])[0] for s in sequences]
    conv_shape, ssm_shape = mamba2_state_shapes(8, 8, num_groups, 16, 4)
    # Slots 0 and 4 are never used: NaN there would show a read of the wrong slot.
    state = (torch.full((5, *conv_shape.per_rank(1)), float("nan")), torch.full((5, *ssm_shape.per_rank(1)), float("nan")))
    # Prefill in two uneven chunks (the second continues from the first's state), then three decode steps.
    plan = [[9, 5, 17], [lengths[0] - 9 - 3, lengths[1] - 5 - 3, lengths[2] - 17 - 3], [1, 1, 1], [1, 1, 1], [1, 1, 1]]
    got = run_chunk_plan(lambda rows, chunks: _step(ours, state, rows, chunks), sequences, [3, 1, 2], plan)
    for i in range(3):
        torch.testing.assert_close(got[i], expected[i], rtol=1e-4, atol=1e-5)


def test_state_shape_per_rank_splits_heads_and_keeps_one_group_whole() -> None:
    one_group, _ = mamba2_state_shapes(8, 8, 1, 16, 4)
    assert one_group.per_rank(1) == (3, 64 + 32) and one_group.per_rank(2) == (3, 32 + 32)
    two_groups, ssm = mamba2_state_shapes(8, 8, 2, 16, 4)
    assert two_groups.per_rank(2) == (3, 32 + 32) and ssm.per_rank(2) == (4, 8, 16)
