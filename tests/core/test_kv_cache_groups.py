"""Grouping layers by attention kind (vLLM's rule), and random workloads over grouped caches: every
read a windowed attention makes finds the right keys, and the books balance after every step."""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kv_groups_utils import WindowCheckingRunner, make_grouped_scheduler, make_request
from sched_utils import expected_output

from pagellm.core.kv_cache_groups import KVCacheGroupSpec, KVCacheLayout, group_layers, single_group_layout
from pagellm.request import RequestStatus


def gemma3_windows(num_layers: int, window: int = 512) -> list:
    return [None if (i + 1) % 6 == 0 else window for i in range(num_layers)]


def test_full_attention_models_keep_one_group_of_every_layer():
    layout = group_layers([None] * 30)
    assert layout == single_group_layout(30)
    assert layout.num_groups == 1 and layout.group_size == 30 and not layout.has_sliding_groups
    assert layout.layer_tensor_ids == tuple(range(30)) and layout.layer_group_ids == (0,) * 30
    assert layout.num_reserved_blocks == 0


def test_mistral_every_layer_sliding_is_one_group():
    layout = group_layers([4096] * 32)
    assert layout.groups == (KVCacheGroupSpec(tuple(range(32)), 4096),)
    assert layout.group_size == 32 and layout.num_reserved_blocks == 1


def test_gemma3_six_layers_make_six_groups_of_one():
    layout = group_layers(gemma3_windows(6))
    assert layout.group_size == 1
    assert [g.layer_ids for g in layout.groups] == [(5,), (0,), (1,), (2,), (3,), (4,)]
    assert layout.group_windows == (None, 512, 512, 512, 512, 512)
    assert layout.layer_tensor_ids == (0,) * 6  # every layer in the one shared tensor
    assert layout.layer_group_ids == (1, 2, 3, 4, 5, 0)


def test_gemma3_1b_pads_the_sliding_kind_over_its_last_groups():
    layout = group_layers(gemma3_windows(26))  # 22 sliding layers, 4 full (5, 11, 17, 23)
    assert layout.group_size == 4
    assert layout.groups[0] == KVCacheGroupSpec((5, 11, 17, 23), None)
    sliding = [g.layer_ids for g in layout.groups[1:]]
    # cdiv(22, 4) = 6 groups, group i taking every 6th sliding layer from the i-th.
    assert sliding == [(0, 7, 14, 21), (1, 8, 15, 22), (2, 9, 16, 24), (3, 10, 18, 25), (4, 12, 19), (6, 13, 20)]
    assert layout.layer_tensor_ids[24] == 3 and layout.layer_group_ids[24] == 3


def test_gpt_oss_alternating_is_two_groups():
    layout = group_layers([128 if i % 2 == 0 else None for i in range(24)])
    assert layout.group_size == 12
    assert layout.groups == (KVCacheGroupSpec(tuple(range(1, 24, 2)), None), KVCacheGroupSpec(tuple(range(0, 24, 2)), 128))


def test_nearly_equal_kinds_pad_to_the_larger_instead_of_splitting():
    layout = group_layers([None] * 13 + [64] * 12)
    assert layout.group_size == 13 and layout.num_groups == 2
    assert layout.describe() == "2 groups of 13 layers (1 full, 1 sliding W=64)"


def test_bad_layouts_are_refused():
    with pytest.raises(ValueError, match="positive"):
        group_layers([0, None])
    with pytest.raises(ValueError, match="at least one layer"):
        group_layers([])
    with pytest.raises(ValueError, match="cover the attention layers"):
        KVCacheLayout((KVCacheGroupSpec((0,)),), 1, 2)


def test_peak_blocks_per_request_bound_the_window():
    layout = group_layers(gemma3_windows(6))
    # 4096 tokens in blocks of 16, one decode token a step: 256 full blocks, 33 per sliding group.
    assert layout.max_blocks_per_request(4096, 16, 1) == 256 + 5 * 33
    assert single_group_layout(6).max_blocks_per_request(4096, 16, 1) == 256
    assert layout.max_tokens_that_fit(1 + 256 + 5 * 33, 16, 1, 10**6) == 4096
    assert single_group_layout(2).max_tokens_that_fit(10, 16, 8, 10**6) == 160  # as num_blocks * block_size


LAYOUTS = [
    [None, None],
    [6, 6],
    [None, 6],
    [None, 3, 8, 8],  # three kinds: full, window 3, window 8 (two layers)
    [5, 5, None, 5, 5, 5],
]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layout=st.sampled_from(LAYOUTS),
    requests=st.lists(
        st.tuples(st.lists(st.integers(1, 4), min_size=1, max_size=24), st.integers(1, 14), st.integers(0, 5), st.booleans()),
        min_size=1,
        max_size=8,
    ),
    num_blocks=st.integers(10, 48),
    block_size=st.sampled_from([1, 2, 4]),
    budget=st.integers(3, 24),
    max_num_seqs=st.integers(1, 5),
    caching=st.booleans(),
)
def test_random_workloads_read_the_right_keys(layout, requests, num_blocks, block_size, budget, max_num_seqs, caching):
    max_model_len = 40
    sched = make_grouped_scheduler(layout, num_blocks, block_size, max_num_seqs, budget, max_model_len, caching)
    kv = sched.kv_cache_manager
    need = kv.kv_cache_layout.max_blocks_per_request(max_model_len, block_size, budget) + kv.block_pool.num_reserved_blocks
    if num_blocks < need:  # every request must fit the pool on its own, or it could never run
        sched = make_grouped_scheduler(layout, need, block_size, max_num_seqs, budget, max_model_len, caching)
        kv = sched.kv_cache_manager
    runner = WindowCheckingRunner.for_scheduler(sched)
    outputs: dict[str, list[int]] = {}
    aborted: set[str] = set()
    pending = sorted(enumerate(requests), key=lambda x: x[1][2])
    step = 0
    while pending or sched.has_unfinished_requests():
        while pending and pending[0][1][2] <= step:
            i, (prompt, max_tokens, _, _) = pending.pop(0)
            sched.add_request(make_request(sched, str(i), prompt, max_tokens=min(max_tokens, max_model_len - len(prompt))))
        for i, (_, _, arrive, abort) in enumerate(requests):
            if abort and step == arrive + 3 and str(i) in sched.requests:
                sched.finish_requests([str(i)], RequestStatus.FINISHED_ABORTED)
                aborted.add(str(i))
        out = sched.schedule()
        for o in sched.update_from_output(out, runner.execute(out)):
            outputs.setdefault(o.req_id, []).extend(o.new_token_ids)
        kv.check_integrity()
        for req in sched.running:
            # A sliding group never holds more than its window and one step's chunk.
            for manager in kv.group_managers:
                if manager.sliding_window is not None:
                    bound = -(-(manager.sliding_window - 1 + budget) // block_size) + 1
                    assert manager.num_held_blocks(req.request_id) <= bound
        step += 1
        assert step < 3000
    assert kv.block_pool.num_used_blocks == 0
    for i, (prompt, max_tokens, _, _) in enumerate(requests):
        if str(i) not in aborted:
            assert outputs[str(i)] == expected_output(prompt, min(max_tokens, max_model_len - len(prompt)))


def test_a_hybrid_models_recurrent_layers_are_the_state_kind_beside_its_attention_groups():
    layout = group_layers([None] * 8, state_layer_ids=(0, 1, 2, 4, 5, 6))
    assert [g.layer_ids for g in layout.groups] == [(3, 7)]
    assert layout.state_layer_ids == (0, 1, 2, 4, 5, 6) and layout.has_state and not layout.plain
    assert layout.layer_group_ids == (-1, -1, -1, 0, -1, -1, -1, 0)
    assert layout.layer_tensor_ids == (0, 1, 2, 0, 3, 4, 5, 1)  # attention: KV tensor; recurrent: state tensors
    assert "6 recurrent layers" in layout.describe()
    with pytest.raises(ValueError, match="at least one attention layer"):
        group_layers([None] * 2, state_layer_ids=(0, 1))


def test_mlp_only_blocks_hold_nothing_beside_recurrent_and_attention_layers():
    # Nemotron-H's "M-M*-": Mamba at 0 and 2, attention at 4, MLP-only blocks at 1, 3 and 5.
    layout = group_layers([None] * 6, state_layer_ids=(0, 2), no_cache_layer_ids=(1, 3, 5))
    assert layout.groups == (KVCacheGroupSpec((4,), None),) and layout.group_size == 1
    assert layout.layer_group_ids == (-1, -1, -1, -1, 0, -1)
    assert layout.layer_tensor_ids == (0, 0, 1, 0, 0, 0)  # state tensors 0 and 1; the attention layer's KV tensor 0
    assert not layout.plain and "3 layers without a cache" in layout.describe()
    attention_only = group_layers([None] * 3, no_cache_layer_ids=(1,))
    assert attention_only.groups == (KVCacheGroupSpec((0, 2), None),) and attention_only.layer_group_ids == (0, -1, 0)
    assert not attention_only.plain


def test_layers_reading_an_earlier_layers_kv_own_no_blocks():
    # Gemma 4's shape in small: five sliding (W=8) to one full; layers 6 and 7 read layers 4 and 5's KV.
    windows = [8, 8, 8, 8, 8, None, 8, None]
    layout = group_layers(windows, kv_shared_layers=((6, 4), (7, 5)))
    assert [g.layer_ids for g in layout.groups] == [(5,), (0,), (1,), (2,), (3,), (4,)]
    assert layout.layer_group_ids == (1, 2, 3, 4, 5, 0, 5, 0)  # the readers use their sources' block tables
    assert layout.layer_tensor_ids == (0,) * 8
    assert "2 layers reading an earlier layer's KV" in layout.describe()
    with pytest.raises(ValueError, match="holds none of its own or attends over another window"):
        group_layers(windows, kv_shared_layers=((6, 5),))  # a sliding layer cannot read a full layer's KV
    with pytest.raises(ValueError, match="holds none of its own"):
        group_layers(windows, kv_shared_layers=((6, 4), (7, 6)))  # a reader is no source
    with pytest.raises(ValueError, match="two roles"):
        group_layers([None] * 4, state_layer_ids=(0,), no_cache_layer_ids=(0,))
