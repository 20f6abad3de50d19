"""tools/scripts/spot_check_economics.py: the simulation through the reference coordinator's spot checks agrees
with the closed form, never fails an honest node, and notices when either no longer holds."""

from __future__ import annotations

import math

import pytest

from coordinator_client.spot_checks import SpotChecks
from tools.scripts import spot_check_economics as econ

F, P = 0.1, 0.999


def _run(spot_checks=SpotChecks, seed=7, trials=40):
    # 40 trials, 200 samples per share: enough for a 99th percentile within ~30% of the law's
    return econ.simulate(F, P, trials=trials, seed=seed, honest_jobs=20, honest=20,
                         cheaters=(1.0,) * 5 + (0.1,) * 5, spot_checks=spot_checks)


def _check(out):
    assert out.honest_failed == 0, f"{out.honest_failed} honest nodes failed"
    for s, xs in out.caught.items():
        p99, n99 = econ.quantile(xs, 0.99), econ.n_caught(F, P, s)
        assert 0.5 <= p99 / n99 <= 2, (s, p99, n99)
        assert 0.5 <= econ.quantile(xs, 0.5) / econ.n_caught(F, P, s, 0.5) <= 2, s
    assert out.checked / out.jobs == pytest.approx(F, rel=0.1)


def test_the_closed_form():
    assert econ.n_caught(0.05, 1.0, 1.0) == 90  # 1 - 0.95^90 >= 0.99 > 1 - 0.95^89
    assert econ.n_caught(0.05, 0.999, 0.01) == math.ceil(math.log(0.01) / math.log(1 - 0.05 * 0.999 * 0.01))
    assert econ.n_caught(0.1, 0.0, 1.0) == math.inf


@pytest.mark.parametrize("seed", [7, 8])
def test_the_simulation_agrees_with_the_closed_form_and_fails_no_honest_node(seed):
    _check(_run(seed=seed))


class _Blind(SpotChecks):
    """Counts no failed verdict: a cheater is never caught."""

    def answered(self, frame):
        frame.job_done.verdict.passed = True
        super().answered(frame)


class _Confused(SpotChecks):
    """Books each verdict against a random node's name: honest nodes take cheaters' failures."""

    def sent(self, verify_job_id, producer, job_id):
        super().sent(verify_job_id, self._rng.choice([producer, "honest-0"]), job_id)


@pytest.mark.parametrize("broken", [_Blind, _Confused])
def test_the_check_fails_when_the_tally_is_wrong(broken):
    with pytest.raises(AssertionError):
        _check(_run(broken, trials=4))  # few: a blind tally serves each cheater 20 x n99 jobs
