"""Randomized fault trials (bench/chaos_trials.py) at a small size: kills, endpoint
outages, 503/429 storms and slow, half, dropped and garbled answers. Every fault is the
infrastructure's, so each trial must end with every request answered exactly once and
no error line, and a kill may cost only the answers since the last durable checkpoint."""

from __future__ import annotations

import pytest

from tests.scripts import BENCH, load_script

pytestmark = [pytest.mark.service, pytest.mark.waits]  # its own lane: docs/testing.md

TRIALS = 20


def _chaos_module():
    return load_script("bench_chaos_trials", BENCH / "chaos_trials.py")


@pytest.fixture(scope="module")
def chaos():
    return _chaos_module()


@pytest.fixture(scope="module")
def totals():
    return {"kills": 0, "outages": 0, "storms": 0, "infra_exits": 0}


@pytest.mark.parametrize("seed", range(1000, 1000 + TRIALS))
def test_chaos_trial_loses_nothing_and_fails_nothing(chaos, totals, seed, tmp_path):
    result = chaos.run_trial(seed, tmp_path / "trial", requests=400, time_limit_s=90)
    assert not result.problems, result
    assert (result.lost, result.duplicated, result.error_lines) == (0, 0, 0), result
    assert result.kill_over_window == 0, result
    for key in totals:
        totals[key] += getattr(result, key)


def test_the_trials_exercised_every_kind_of_fault(totals):
    # Runs after the trials (file order): the seeds above must have produced each event kind.
    assert totals["kills"] > 0 and totals["outages"] > 0 and totals["storms"] > 0, totals
    assert totals["infra_exits"] > 0, totals  # some outage outlasted the budget: a retry finished it
