"""Tensor-parallel ranks' offloading tier reports joined into the one the scheduler reads: a load is
done once every rank finished it, with the fewest items any rank loaded; a key any rank dropped is
dropped; bytes add up over ranks, page counts do not; at start, the keys every rank holds."""
from __future__ import annotations

import pytest

from pagellm.core.sched_output import ModelRunnerOutput
from pagellm.executor.kv_tier import RankTierReport, TierReportJoiner, common_keys
from pagellm.kv_offload import OffloaderStats


def test_a_load_is_done_when_every_rank_finished_it_with_the_fewest_items():
    joiner = TierReportJoiner(3)
    step1 = joiner.join([RankTierReport({"a": 4, "b": 2}), RankTierReport({"a": 4}), RankTierReport({})])
    assert step1.loaded == {} and joiner.num_partial == 2
    step2 = joiner.join([RankTierReport({}), RankTierReport({"b": 2}), RankTierReport({"a": 1, "b": 2})])
    assert step2.loaded == {"a": 1, "b": 2} and joiner.num_partial == 0  # "a" failed at its second page on rank 2
    # A request loads again (after a preemption): a fresh round.
    assert joiner.join([RankTierReport({"a": 3})] * 3).loaded == {"a": 3}


def test_keys_any_rank_dropped_are_dropped_once():
    joiner = TierReportJoiner(2)
    joined = joiner.join([RankTierReport(removed=[b"k1", b"k2"]), RankTierReport(removed=[b"k2", b"k3"])])
    assert joined.removed == [b"k1", b"k2", b"k3"]


def test_bytes_add_up_over_ranks_and_counts_are_the_largest():
    r0 = OffloaderStats(bytes_written=100, bytes_used=300, page_bytes=10, num_corrupt=0, num_pages_loaded=4, load_seconds=0.5)
    r1 = OffloaderStats(bytes_written=120, bytes_used=330, page_bytes=11, num_corrupt=1, num_pages_loaded=4, load_seconds=0.7)
    joined = TierReportJoiner(2).join([RankTierReport(stats=r0), RankTierReport(stats=r1)]).stats
    assert (joined.bytes_written, joined.bytes_used, joined.page_bytes) == (220, 630, 21)
    assert (joined.num_corrupt, joined.num_pages_loaded, joined.load_seconds) == (1, 4, 0.7)


def test_rank_zeros_output_carries_the_joined_report():
    joiner = TierReportJoiner(2)
    out = ModelRunnerOutput({}, kv_loads_done={"a": 3}, kv_tier_removed=[b"x"], kv_tier_stats=OffloaderStats(num_corrupt=0))
    joiner.apply(out, [RankTierReport({"a": 0}, [b"y"], OffloaderStats(num_corrupt=1))])
    assert out.kv_loads_done == {"a": 0} and out.kv_tier_removed == [b"x", b"y"] and out.kv_tier_stats.num_corrupt == 1
    plain = ModelRunnerOutput(sampled_token_ids={}, kv_loads_done={})
    joiner.apply(plain, [None])  # ranks without a tier report nothing
    assert plain.kv_loads_done == {}
    with pytest.raises(ValueError, match="3 tier reports for 2 ranks"):
        joiner.join([RankTierReport()] * 3)


def test_the_tier_starts_with_the_keys_every_rank_holds():
    assert common_keys([[b"a", b"b", b"c"], [b"c", b"a"]]) == [b"a", b"c"]
    assert common_keys([[b"a", b"b"]]) == [b"a", b"b"]
