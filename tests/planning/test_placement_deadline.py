"""Deadline-aware placement (paper Eq. 1) and the loader's deadline estimator: pure code, plain
data in and out, an injected clock."""

import pytest

from helix_core.loader.deadline import DeadlineEstimator
from helix_core.planning.placement import Candidates, DeadlineAware, PlacementRequest, make_scheduler


def cands(queued, kinds=None, workers=None, local=0, lpc=None, outstanding=None, bandwidth=None):
    n = len(queued)
    return Candidates(
        tuple(f"s{k}" for k in range(n)),
        tuple(kinds or ["local"] * n),
        tuple(workers or [1] * n),
        tuple(outstanding or [0] * n),
        (0,) * n,
        tuple(lpc or [1.0] * n),
        local,
        tuple(queued),
        tuple(bandwidth or [0.0] * n),
        (0.0,) * n,
    )


def req(cpu_s=0.1, deadline_s=1.0, out_bytes=0):
    return PlacementRequest(rank=0, task_id=1, cpu_s=cpu_s, out_bytes=out_bytes, deadline_s=deadline_s)


P = DeadlineAware()


def test_finish_time_is_queue_plus_cpu_scaled_by_measured_latency_plus_network():
    c = cands(
        [0.4, 0.4, 0.0],
        kinds=["local", "local", "remote"],
        workers=[2, 1, 1],
        lpc=[1.0, 2.0, 1.0],
        bandwidth=[0, 0, 1e8],
    )
    t = P.finish_times(req(cpu_s=0.1, out_bytes=10_000_000), c)
    assert t[0] == pytest.approx(0.4 / 2 + 0.1)  # its work spread over 2 workers, no network (shared memory)
    assert t[1] == pytest.approx(0.4 * 2 + 0.1 * 2)  # measured: twice as slow as predicted
    assert t[2] == pytest.approx(0.1 + 0.1 + P.default_link_latency_s)  # 10 MB over 100 MB/s


def test_all_meet_stays_local_and_the_own_server_wins_near_ties():
    d = P.choose(req(deadline_s=2.0), cands([0.05, 0.0, 0.0]))
    assert d.server_id == "s0" and d.reason == "local-meets"
    assert d.finish_by_server()["s0"] == pytest.approx(0.15)
    # another local server (shared memory too) is ready much sooner: it takes the batch
    d = P.choose(req(deadline_s=2.0), cands([1.5, 0.0, 0.2]))
    assert d.server_id == "s1" and d.reason == "local-meets"


def test_all_miss_goes_to_the_earliest_finish():
    d = P.choose(req(deadline_s=0.05), cands([0.9, 0.3, 0.6]))
    assert d.server_id == "s1" and d.reason == "earliest-finish"
    no_deadline = P.choose(req(deadline_s=None), cands([0.9, 0.3, 0.6]))
    assert no_deadline.server_id == "s1" and no_deadline.reason == "earliest-finish"


def test_remote_gain_below_and_above_the_threshold():
    kinds = ["local", "remote"]
    # the local server meets (0.9 <= 1.0); the sidecar is ready 0.8 s sooner: more than 0.5 x D -> move
    d = P.choose(req(cpu_s=0.1, deadline_s=1.0), cands([0.8, 0.0], kinds=kinds, local=0))
    assert d.server_id == "s1" and d.reason == "remote-gain"
    # gain 0.3 s < 0.5 x D: stay local, shared memory costs nothing
    d = P.choose(req(cpu_s=0.1, deadline_s=1.0), cands([0.3, 0.0], kinds=kinds, local=0))
    assert d.server_id == "s0" and d.reason == "local-meets"
    # only the sidecar can meet the deadline
    d = P.choose(req(cpu_s=0.1, deadline_s=1.0), cands([2.0, 0.0], kinds=kinds, local=0))
    assert d.server_id == "s1" and d.reason == "meets-deadline"


def test_best_meeting_candidate_by_locality_and_backpressure():
    # the own server (s0) misses; s1 (remote) and s2 (local) both meet with equal finish: locality prefers s2
    c = cands([2.0, 0.1, 0.1], kinds=["local", "remote", "local"], local=0)
    d = P.choose(req(cpu_s=0.1, deadline_s=1.0), c)
    assert d.server_id == "s2" and d.reason == "local-meets"
    # equal finish and kind: fewer outstanding requests per worker wins (backpressure)
    c = cands([2.0, 0.1, 0.1], local=0, outstanding=[0, 6, 1])
    assert P.choose(req(cpu_s=0.1, deadline_s=1.0), c).server_id == "s2"


def test_ties_are_deterministic_lowest_position_and_own_server_first():
    c = cands([0.5, 0.5, 0.5], local=None)
    assert P.choose(req(deadline_s=0.01), c).server_id == "s0"
    c = cands([0.5, 0.5, 0.5], local=2)
    assert P.choose(req(deadline_s=0.01), c).server_id == "s2"  # all miss equally: stay local
    assert [P.choose(req(deadline_s=0.5), cands([0.2, 0.2, 0.6], local=2)).server_id for _ in range(3)] == ["s0"] * 3


def test_policies_by_name_and_validation():
    assert isinstance(make_scheduler("deadline"), DeadlineAware)
    with pytest.raises(ValueError, match="deadline, least-request"):
        make_scheduler("fastest")
    with pytest.raises(ValueError, match="no live DataServer"):
        P.choose(req(), Candidates((), (), (), ()))
    with pytest.raises(ValueError, match="different lengths"):
        Candidates(("a",), ("local",), (1,), (0,), queued_cpu_s=(0.0, 1.0))


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_deadlines_come_from_measured_windows_per_unit_of_gpu_cost():
    clock = Clock()
    est = DeadlineEstimator(quantile=1.0, clock=clock)  # the slowest window: each new one counts
    for p, units in enumerate([100, 100, 300, 100]):
        est.expect(p, units)
    assert est.deadline(1) is None  # nothing measured yet
    est.asked()
    est.yielded(0)  # next() returned batch 0: its window starts
    clock.t += 0.5
    est.asked()  # next() again: batch 0 took 0.5 s for 100 units
    assert est.seconds_per_unit == pytest.approx(0.005)
    assert est.deadline(1) == 0.0  # the rank is asking for batch 1 now
    assert est.deadline(3) == pytest.approx(0.5 + 1.5)  # batches 1 and 2 first; 2 is 3x heavier
    est.yielded(1)
    clock.t += 0.2
    assert est.deadline(2) == pytest.approx(0.3)  # what is left of batch 1's window
    assert est.deadline(3) == pytest.approx(0.3 + 1.5)
    est.report(1.0)  # the trainer measured batch 1's window: it wins over the gap between next() calls
    clock.t += 0.1
    est.asked()
    assert est.seconds_per_unit == pytest.approx(0.01)
    with pytest.raises(ValueError, match="report_step_time"):
        est.report(-1.0)


def test_a_batch_fans_out_only_when_one_worker_would_miss_its_deadline():
    from helix_core.data.descriptors import CostProfile
    from helix_core.planning.fanout import fan_out as _fan_out

    def costs(*cpu):
        return [CostProfile(cpu_s=c, io_bytes=0, out_bytes=0, tokens=0, profile="") for c in cpu]

    assert _fan_out([7, 8], costs(0.1, 0.1), deadline_s=1.0) == [[7, 8]]  # one worker makes it
    assert _fan_out([7, 8], costs(0.1, 0.1), deadline_s=0.05) == [[7], [8]]  # two large clips: ready in the time of one
    assert _fan_out([1, 2, 3, 4], costs(0.3, 0.1, 0.1, 0.1), deadline_s=0.3) == [
        [1],
        [2, 3, 4],
    ]  # contiguous, equal cost
    assert _fan_out([7, 8], [None, None], deadline_s=0.0) == [[7, 8]]  # unknown costs: never split
    assert _fan_out([7], costs(5.0), deadline_s=0.0) == [[7]]


def test_windows_that_waited_for_a_starved_rank_do_not_stretch_the_deadlines():
    """A window includes the gradient sync; when another rank's input is late, this rank's window
    holds that wait. Deadlines follow what the rank computes when nobody makes it wait, so a
    starved job's slow pace does not become the target placement aims for."""
    clock = Clock()
    est = DeadlineEstimator(clock=clock)
    for p in range(40):
        est.expect(p, 100)
        est.yielded(p)
        clock.t += 0.2 if p % 4 == 0 else 0.8  # 1 in 4 steps it is the slowest rank: no wait
        est.asked()
    assert est.seconds_per_unit == pytest.approx(0.002)
    for p in range(40, 43):
        est.expect(p, 100)
    assert est.deadline(43) == pytest.approx(3 * 0.2)
    with pytest.raises(ValueError, match="quantile"):
        DeadlineEstimator(quantile=1.5)


def test_a_batch_whose_cost_was_measured_is_learned_against_the_measurement():
    """Tier 2 tells the estimator what the rank's batch really costs: its window is learned per
    measured unit, so a wrong estimate does not skew the seconds per unit."""
    clock = Clock()
    est = DeadlineEstimator(quantile=1.0, clock=clock)
    est.expect(0, 100)  # the estimate: 100 units ...
    est.measured(0, 400)  # ... decoding measured 400
    est.measured(7, 0)  # nonsense is ignored
    est.asked()
    est.yielded(0)
    clock.t += 2.0
    est.asked()
    assert est.seconds_per_unit == pytest.approx(2.0 / 400)
