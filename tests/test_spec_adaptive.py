"""Adaptive drafting: a request pauses drafting when its accepted share of drafts falls below what its drafts cost,
and that cost is measured on the engine's own decode steps (spec_decode/speculator.py: SpecStats, DraftRowCost)."""
from __future__ import annotations

import pytest

from stateserve.spec_decode.speculator import LOW_ACCEPTANCE, MIN_STEPS_BEFORE_PAUSE, DraftRowCost, SpecStats


def test_draft_cost_is_the_step_time_drafts_add_per_draft():
    cost = DraftRowCost()
    assert cost.break_even(4) == LOW_ACCEPTANCE
    cost.record(num_seqs=1, drafts=4, seconds=0.02)  # no plain step of one sequence seen yet: nothing to compare
    assert cost.break_even(4) == LOW_ACCEPTANCE
    for _ in range(3):
        cost.record(num_seqs=1, drafts=0, seconds=0.010)
    cost.record(num_seqs=2, drafts=0, seconds=0.050)  # another batch size: its own reference
    for _ in range(40):
        cost.record(num_seqs=1, drafts=4, seconds=0.022)  # 4 drafts add 1.2 of a step: 0.3 each
        cost.record(num_seqs=1, drafts=2, seconds=0.018)  # a fixed part too: 2 drafts add 0.8, 0.4 each
    assert cost.break_even(4) == pytest.approx(0.3, abs=1e-3)
    assert cost.break_even(2) == pytest.approx(0.4, abs=1e-3)
    assert cost.break_even(3) == LOW_ACCEPTANCE  # not measured
    for _ in range(40):
        cost.record(num_seqs=1, drafts=4, seconds=0.0101)  # nearly free rows: never below the floor
    assert cost.break_even(4) == LOW_ACCEPTANCE


@pytest.mark.parametrize("break_even,pauses", [(0.2, False), (0.35, True)])
def test_a_request_pauses_below_the_break_even_share(break_even, pauses):
    stats = SpecStats()
    for _ in range(MIN_STEPS_BEFORE_PAUSE + 8):  # 3 of 4 drafts rejected, step after step: share 0.25
        if stats.paused:
            break
        stats.record(4, 1, break_even)
    assert bool(stats.paused) == pauses
    assert stats.offer(4) == (0 if pauses else 2)
