"""FusedMoE's sigmoid scoring with a score-correction bias and a routed scaling factor against
transformers' LFM2-MoE block (sigmoid scores, the bias added to choose the top k only, the chosen
unbiased scores renormalised, then scaled), in float32."""
from __future__ import annotations

import pytest
import torch
from transformers import Lfm2MoeConfig
from transformers.models.lfm2_moe.modeling_lfm2_moe import Lfm2MoeSparseMoeBlock

from pagellm.layers.moe import FusedMoE

HIDDEN, INTER, EXPERTS, TOP_K = 32, 24, 6, 2


def _pair(norm_topk_prob: bool, scaling: float) -> tuple[Lfm2MoeSparseMoeBlock, FusedMoE]:
    torch.manual_seed(0)
    config = Lfm2MoeConfig(
        hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
        norm_topk_prob=norm_topk_prob, routed_scaling_factor=scaling, use_expert_bias=True,
    )
    ref = Lfm2MoeSparseMoeBlock(config).eval()
    with torch.no_grad():
        for param in ref.parameters():
            param.normal_(0.0, 0.3)
        # Large enough to change which experts win, so a bias ignored or used as a weight shows.
        ref.expert_bias.copy_(torch.randn(EXPERTS) * 0.5)
    moe = FusedMoE(
        HIDDEN, EXPERTS, TOP_K, INTER, renormalize=norm_topk_prob,
        scoring="sigmoid", e_score_correction_bias=True, routed_scaling_factor=scaling,
    )
    moe.gate.load_checkpoint_tensor("weight", None, ref.gate.weight.detach().clone())
    for e, expert in enumerate(moe.experts):
        gate, up = ref.experts.gate_up_proj[e].detach().chunk(2, dim=0)
        expert.gate_up_proj.load_checkpoint_tensor("weight", "gate", gate.clone())
        expert.gate_up_proj.load_checkpoint_tensor("weight", "up", up.clone())
        expert.down_proj.load_checkpoint_tensor("weight", None, ref.experts.down_proj[e].detach().clone())
    assert moe.missing_weights() == ["e_score_correction_bias"]
    moe.load_checkpoint_tensor("e_score_correction_bias", None, ref.expert_bias.clone())
    assert moe.missing_weights() == []
    for module in moe.modules():
        if hasattr(module, "process_weights_after_loading") and module.method is None:
            module.process_weights_after_loading()
    return ref, moe


@pytest.mark.parametrize("norm_topk_prob,scaling", [(True, 1.0), (False, 2.5)])
def test_sigmoid_scoring_with_correction_bias_matches_transformers(norm_topk_prob: bool, scaling: float) -> None:
    ref, moe = _pair(norm_topk_prob, scaling)
    x = torch.randn(1, 40, HIDDEN)
    with torch.no_grad():
        expected = ref(x)[0]
        got = moe(x[0])
        _, ref_weights, ref_ids = ref.gate(x[0], ref.expert_bias)
        weights, ids = moe.route(x[0])
    # The bias changes the choice for some tokens: otherwise this test could not see it.
    plain_ids = torch.topk(torch.sigmoid(x[0] @ ref.gate.weight.t()), TOP_K, dim=-1).indices
    assert not torch.equal(plain_ids.sort(-1).values, ids.sort(-1).values)
    assert torch.equal(ids.sort(-1).values, ref_ids.sort(-1).values)
    # transformers adds 1e-6 to the renormalising sum (vLLM does not): equal to that.
    torch.testing.assert_close(weights.sort(-1).values, ref_weights.sort(-1).values, rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_unknown_scoring_and_foreign_tensors_are_refused() -> None:
    with pytest.raises(ValueError, match="scoring"):
        FusedMoE(HIDDEN, EXPERTS, TOP_K, INTER, scoring="softplus")
    moe = FusedMoE(HIDDEN, EXPERTS, TOP_K, INTER)
    with pytest.raises(ValueError, match="e_score_correction_bias"):
        moe.load_checkpoint_tensor("e_score_correction_bias", None, torch.zeros(EXPERTS))
    assert moe.missing_weights() == []
