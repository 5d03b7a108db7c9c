"""What one long request holds: a Gemma 3-shape model (five sliding layers of window 512 to one
full-attention layer) against the same six layers all attending fully, block size 16."""
from kv_groups_utils import make_grouped_scheduler, make_request
from sched_utils import FakeRunner

from pagellm.core.kv_cache_groups import group_layers

GEMMA3_6 = [512, 512, 512, 512, 512, None]
FULL_6 = [None] * 6


def held_at(layer_windows, num_tokens: int, budget: int = 1024) -> tuple[int, int]:
    """(pool blocks, layer-blocks) the request holds in the step that computes its token ``num_tokens - 1``,
    its prompt having been prefilled in chunks of ``budget``."""
    layout = group_layers(layer_windows)
    need = layout.max_blocks_per_request(num_tokens + 1, 16, budget) + layout.num_reserved_blocks
    sched = make_grouped_scheduler(layer_windows, need, 16, 1, budget, num_tokens + 8)
    sched.add_request(make_request(sched, "a", [7] * (num_tokens - 1), max_tokens=2))
    kv, runner = sched.kv_cache_manager, FakeRunner(16)
    while True:
        out = sched.schedule()
        if sched.requests["a"].num_computed_tokens == num_tokens:
            kv.check_integrity()
            held = kv.num_held_blocks("a")
            return held, held * layout.group_size
        sched.update_from_output(out, runner.execute(out, sched.requests))


def test_a_gemma3_shape_request_holds_a_sixth_plus_the_windows():
    full_blocks, full_layer_blocks = held_at(FULL_6, 4096)
    hybrid_blocks, hybrid_layer_blocks = held_at(GEMMA3_6, 4096)
    # Full attention: 256 blocks of six layers. Gemma 3's shape: 256 full-attention blocks of one
    # layer, and 32 per sliding layer (positions 3584-4095: the window of the query at 4095).
    assert (full_blocks, full_layer_blocks) == (256, 1536)
    assert (hybrid_blocks, hybrid_layer_blocks) == (256 + 5 * 32, 416)
    assert hybrid_layer_blocks / full_layer_blocks < 1 / 6 + 5 / 6 * 33 / 256
