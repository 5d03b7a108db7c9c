"""step_cost: what a step costs by width, as prefill chunks or (``--verify``) as real verifications."""
from __future__ import annotations

import re

import numpy as np

from pagellm.bench import step_cost
from pagellm.spec_decode.ngram_proposer import NgramProposer


def test_forced_drafts_never_miss_and_are_undone() -> None:
    proposer = NgramProposer(2, 2)
    with step_cost.forced_drafts():
        assert proposer.propose(np.array([5, 6, 7]), 3) == [7, 7, 7]
    assert proposer.propose(np.array([5, 6, 7]), 3) == []  # no earlier "6, 7": the real lookup again


def test_verify_widths_are_timed_on_verification_steps(capsys) -> None:
    assert step_cost.main(["--widths", "1,3", "--verify", "--engine-args", '{"max_model_len": 512}']) == 0
    out = capsys.readouterr().out
    rows = dict(re.findall(r"^\s*(\d+ \w+): .*; (\d+) steps\)$", out, flags=re.M))
    assert set(rows) == {"1 tokens", "3 verifying"}, out
    assert all(int(n) > 30 for n in rows.values()), out  # every decode step after the first few verifies two drafts
