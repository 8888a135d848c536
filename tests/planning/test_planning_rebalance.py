"""Tier-2 policy and plan (pure): the user's config, valid assignments, sends / receives / keeps,
the default policy's equal-count LPT and its cost gate."""

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import helix_core as hx
from helix_core.tier2.rebalance import (
    GateArgs,
    Rebalance,
    balance_cost,
    check_assignment,
    default_features,
    gate,
    lpt_within_steps,
    plan_moves,
    projected_gain_s,
    step_loads,
    transfer_s,
)


def _round(costs_by_step_rank: list[list[list[float]]], nbytes: int = 1000) -> list[dict]:
    """Features of a round: ``costs[step][rank]`` lists the costs of that rank's samples."""
    return [
        {"cost": c, "bytes": nbytes, "rank": r, "step": s}
        for s, ranks in enumerate(costs_by_step_rank)
        for r, cs in enumerate(ranks)
        for c in cs
    ]


def test_the_config_takes_the_papers_keys_and_names_what_is_wrong():
    def sort(features, args):
        return [f["rank"] for f in features]

    r = Rebalance.of(
        {
            "feature_fn": default_features,
            "sort_fn": sort,
            "client_ranks": [[0, 1], [2, 3]],
            "buffer_size": 64,
            "args": {"margin": 0.2},
        }
    )
    assert r.client_ranks == ((0, 1), (2, 3)) and r.groups(4) == ((0, 1), (2, 3))
    assert Rebalance().groups(3) == ((0, 1, 2),) and Rebalance.of(None) is None and hx.Rebalance is Rebalance
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['buffersize'\]"):
        Rebalance.of({"buffersize": 8})
    with pytest.raises(ValueError, match="buffer_size must be an int >= 2"):
        Rebalance(buffer_size=1)
    with pytest.raises(TypeError, match="sort_fn must be a function"):
        Rebalance(sort_fn="lpt")
    with pytest.raises(ValueError, match="rank 1 is in more than one group"):
        Rebalance(client_ranks=[[0, 1], [1, 2]])
    with pytest.raises(ValueError, match="two or more ranks"):
        Rebalance(client_ranks=[[0]])
    with pytest.raises(ValueError, match=r"rank\(s\) \[4\] of group \[2, 4\] not below world_size=4"):
        Rebalance(client_ranks=[[0, 1], [2, 4]]).groups(4)
    with pytest.raises(ValueError, match="round_timeout_s"):
        Rebalance(round_timeout_s=float("nan"))


def test_an_invalid_assignment_is_named():
    f = _round([[[1, 2], [3, 4]], [[5, 6], [7, 8]]])
    assert check_assignment(f, [f_["rank"] for f_ in f]) is None
    assert check_assignment(f, "0101") == "returned str, not a list of ranks"
    assert check_assignment(f, [0] * 7) == "returned 7 ranks for 8 samples"
    assert check_assignment(f, [0, 0, 1, 5, 0, 0, 1, 1]) == "sample 3: rank 5 is not one of the round's ranks [0, 1]"
    assert check_assignment(f, [0, 0, 1, 1.0, 0, 0, 1, 1]) == "sample 3: rank 1.0 is not an int"
    assert check_assignment(f, [0, 0, 0, 1, 0, 0, 1, 1]) == "step 0: rank 0 would get 3 samples, not its batch's 2"
    with pytest.raises(ValueError, match="invalid assignment: step 0"):
        plan_moves(f, [0, 0, 0, 1, 0, 0, 1, 1])


def test_a_move_plan_lists_keeps_and_sends_and_each_rank_receives_what_it_sends_for():
    f = _round([[[9, 8], [1, 1]]])  # step 0: rank 0 holds both heavy samples
    plan = plan_moves(f, [0, 1, 0, 1])
    assert plan.keeps == (0, 3) and plan.sends == ((1, 0, 1), (2, 1, 0)) and plan.moved == 2
    assert plan.sent_by(0) == [(1, 1)] and plan.received_by(0) == [(2, 1)]
    assert step_loads(f, [0, 1, 0, 1]) == {0: {0: 10.0, 1: 9.0}}


@st.composite
def rounds(draw):
    steps, ranks = draw(st.integers(1, 4)), draw(st.integers(2, 4))
    per = draw(st.integers(1, 3))
    costs = [[[draw(st.floats(0, 100)) for _ in range(per)] for _ in range(ranks)] for _ in range(steps)]
    return _round(costs, nbytes=draw(st.integers(0, 10**7)))


@settings(max_examples=200, deadline=None)
@given(rounds(), st.randoms(use_true_random=False))
def test_any_shuffle_within_steps_keeps_batch_sizes_and_moves_each_sample_once(features, rnd):
    assignment = [f["rank"] for f in features]
    by_step = {}
    for p, f in enumerate(features):
        by_step.setdefault(f["step"], []).append(p)
    for positions in by_step.values():  # a random permutation of the step's ranks' slots
        slots = [assignment[p] for p in positions]
        rnd.shuffle(slots)
        for p, r in zip(positions, slots):
            assignment[p] = r
    plan = plan_moves(features, assignment)
    assert sorted(plan.keeps + tuple(p for p, _, _ in plan.sends)) == list(range(len(features)))  # once each
    held = {}
    for p in plan.keeps:
        held.setdefault((features[p]["step"], features[p]["rank"]), []).append(p)
    for p, src, dst in plan.sends:
        assert src == features[p]["rank"] != dst
        held.setdefault((features[p]["step"], dst), []).append(p)
    sizes = {}
    for f in features:
        sizes[f["step"], f["rank"]] = sizes.get((f["step"], f["rank"]), 0) + 1
    assert {k: len(v) for k, v in held.items()} == sizes  # every rank's batch size, at every step


@settings(max_examples=200, deadline=None)
@given(rounds(), st.floats(1e3, 1e12))
def test_the_default_policy_is_valid_and_never_makes_the_slowest_rank_slower(features, bandwidth):
    args = GateArgs(seconds_per_unit=1e-3, bandwidth_bps=bandwidth)
    current = [f["rank"] for f in features]
    for assignment in (lpt_within_steps(features), balance_cost(features, args)):
        assert check_assignment(features, assignment) is None
    out = balance_cost(features, args)
    slowest = lambda a: sum(max(r.values()) for r in step_loads(features, a).values())  # noqa: E731
    assert slowest(out) <= slowest(current) + 1e-9
    move, gain, cost = gate(features, out, args)
    assert out == current or (move and gain > cost)


def test_the_gate_keeps_a_balanced_round_and_moves_only_when_the_gain_pays_for_the_bytes():
    skewed = _round([[[900, 800], [10, 10]]], nbytes=50_000_000)  # rank 0's step is ~85x rank 1's
    fast = GateArgs(seconds_per_unit=1e-3, bandwidth_bps=10e9)
    moved = balance_cost(skewed, fast)  # 1.7 s -> 0.91 s for 10 ms of transfer
    assert step_loads(skewed, moved) == {0: {0: 910.0, 1: 810.0}} and plan_moves(skewed, moved).moved == 2
    slow = GateArgs(seconds_per_unit=1e-3, bandwidth_bps=1e6)  # 50 s per clip: not worth it
    assert balance_cost(skewed, slow) == [0, 0, 1, 1]
    same = GateArgs(seconds_per_unit=1e-3, bandwidth_bps=1e6, same_host={0: "h", 1: "h"})
    assert transfer_s(skewed, [0, 1, 0, 1], same) == same.latency_s  # a slab hand-over: no bytes
    assert balance_cost(skewed, same) == moved
    balanced = _round([[[500, 10], [490, 20]]])
    assert balance_cost(balanced, fast) == [0, 0, 1, 1]  # LPT would move, but 0 s gained
    tiny = _round([[[12, 10], [10, 10]]], nbytes=1)
    assert balance_cost(tiny, GateArgs(seconds_per_unit=1e-9, latency_s=1e-3)) == [0, 0, 1, 1]  # gain < latency


def test_where_every_rank_waits_for_input_a_gpu_saving_under_the_wait_moves_nothing():
    skewed = _round([[[900, 800], [10, 10]], [[700, 700], [10, 10]]], nbytes=1)  # two steps: 1.7 s and 1.4 s
    busy = GateArgs(seconds_per_unit=1e-3, bandwidth_bps=10e9, same_host={0: "h", 1: "h"})
    current = [f["rank"] for f in skewed]
    moved = balance_cost(skewed, busy)
    gpu_bound = projected_gain_s(skewed, moved, busy)  # 0.79 + 0.69 s saved on the slowest ranks
    assert moved != current and abs(gpu_bound - 1.48) < 1e-9
    waiting = dataclasses.replace(busy, input_wait_s=0.7)  # each step waits 0.7 s for its input anyway
    assert abs(projected_gain_s(skewed, moved, waiting) - 0.09) < 1e-9  # only step 0 saves beyond the wait
    assert balance_cost(skewed, dataclasses.replace(busy, input_wait_s=0.8)) == current  # saves nothing: kept
    assert gate(skewed, moved, dataclasses.replace(busy, input_wait_s=0.8))[1] == 0.0


def test_where_input_binds_the_gate_charges_the_copies_of_the_batches_that_change():
    skewed = _round([[[900, 800], [10, 10]]], nbytes=50_000_000)  # one host: slabs handed over, no bytes sent
    slow_copy = GateArgs(seconds_per_unit=1e-3, same_host={0: "h", 1: "h"}, copy_bps=1e8)
    moved = balance_cost(skewed, slow_copy)
    assert moved != [0, 0, 1, 1]  # GPU-bound: the copies run beside the GPU step, for free
    assert transfer_s(skewed, moved, slow_copy) == slow_copy.latency_s
    assert transfer_s(skewed, moved, dataclasses.replace(slow_copy, input_wait_s=0.005)) == slow_copy.latency_s
    starved = dataclasses.replace(slow_copy, input_wait_s=0.02)  # input binds: a copy takes the decoders' CPU
    assert transfer_s(skewed, moved, starved) == slow_copy.latency_s + 4 * 50_000_000 / 1e8  # both ranks' batches
    assert balance_cost(skewed, starved) == [0, 0, 1, 1]  # 2 s of copies for 0.77 s saved: kept
    assert balance_cost(skewed, dataclasses.replace(starved, copy_bps=1e10)) == moved  # 20 ms of copies: moved


def test_default_features_are_the_samples_tokens_and_bytes():
    import torch

    s = {"video": torch.zeros(2, 3, 4, 4, dtype=torch.uint8), "tokens": 32, "index": 7, "meta": [torch.zeros(3)]}
    assert default_features(s) == {"tokens": 32, "bytes": 96 + 12}


def test_a_round_closes_when_full_or_at_its_timeout_and_one_ranks_round_is_not_movable():
    from helix_core.tier2.rounds import RoundBuffer, RoundItem

    now = [0.0]
    buf = RoundBuffer([0, 1], buffer_size=3, timeout_s=0.05, clock=lambda: now[0])
    assert buf.due_in() is None and buf.expire() is None and buf.flush() is None
    assert buf.add(RoundItem("a", 0, 7, {"cost": 5})) is None
    now[0] = 0.02
    assert buf.due_in() == pytest.approx(0.03) and buf.expire() is None
    assert buf.add(RoundItem("b", 1, 7, {"cost": 1})) is None
    full = buf.add(RoundItem("c", 0, 8))
    assert full.closed_by == "full" and [i.key for i in full.items] == ["a", "b", "c"] and full.movable
    assert full.features()[0] == {"cost": 5, "rank": 0, "step": 7} and len(buf) == 0
    now[0] = 1.0
    buf.add(RoundItem("d", 0, 9))
    buf.add(RoundItem("e", 1, 10))  # two ranks, but of different steps: nothing may move
    now[0] = 1.06
    late = buf.expire()
    assert late.closed_by == "timeout" and not late.movable and buf.due_in() is None
    with pytest.raises(ValueError, match="rank 2 is not in this group"):
        buf.add(RoundItem("f", 2, 11))


def test_a_batch_joins_a_round_whole_and_a_round_closes_once_every_step_has_all_ranks():
    from helix_core.tier2.rounds import RoundBuffer, RoundItem

    now = [0.0]
    buf = RoundBuffer([0, 1, 2], buffer_size=8, timeout_s=0.05, clock=lambda: now[0])
    assert buf.add_batch([RoundItem("a0", 0, 3), RoundItem("a1", 0, 3)]) is None
    assert buf.add_batch([RoundItem("b0", 1, 3), RoundItem("b1", 1, 3)]) is None  # rank 2 still to come
    assert buf.add_batch([RoundItem("x0", 0, 4), RoundItem("x1", 0, 4)]) is None  # step 4 is not complete
    got = buf.add_batch([RoundItem("c0", 2, 3), RoundItem("c1", 2, 3), RoundItem("c2", 2, 3)])
    assert got.closed_by == "full" and len(got.items) == 9  # past buffer_size by less than the batch: never cut
    assert buf.add_batch([RoundItem("d0", 1, 5)]) is None
    assert buf.add_batch([RoundItem("e0", 0, 5)]) is None
    done = buf.add_batch([RoundItem("f0", 2, 5)])
    assert done.closed_by == "complete" and [i.key for i in done.items] == ["d0", "e0", "f0"]
    assert buf.add_batch([]) is None and buf.due_in() is None
    with pytest.raises(ValueError, match="rank 7 is not in this group"):
        buf.add_batch([RoundItem("g", 7, 6)])


def test_a_step_sent_again_by_a_rank_replaces_its_earlier_batch():
    from helix_core.tier2.rounds import RoundBuffer, RoundItem

    buf = RoundBuffer([0, 1], buffer_size=8, timeout_s=1.0, clock=lambda: 0.0)
    buf.add_batch([RoundItem("old0", 0, 3), RoundItem("old1", 0, 3)])
    assert [i.key for i in buf.drop(0, 3)] == ["old0", "old1"] and buf.due_in() is None and buf.drop(1, 3) == []
    buf.add_batch([RoundItem("new0", 0, 3)])
    done = buf.add_batch([RoundItem("b0", 1, 3)])
    assert done.closed_by == "complete" and [i.key for i in done.items] == ["new0", "b0"]


def test_a_batch_that_leaves_a_round_takes_its_timeout_with_it():
    from helix_core.tier2.rounds import RoundBuffer, RoundItem

    now = [0.0]
    buf = RoundBuffer([0, 1, 2], buffer_size=8, timeout_s=1.0, clock=lambda: now[0])
    buf.add_batch([RoundItem("hurried", 0, 3)], timeout_s=0.2)
    buf.add_batch([RoundItem("patient", 1, 3)], timeout_s=5.0)
    assert buf.due_in() == pytest.approx(0.2)
    buf.drop(0, 3)  # the hurried rank left: the rest may wait for their own limit
    now[0] = 1.0
    assert buf.due_in() == pytest.approx(4.0) and buf.expire() is None
    now[0] = 5.0
    assert [i.key for i in buf.expire().items] == ["patient"]


def test_a_rank_that_asks_for_its_batch_closes_the_round_now_whatever_its_limits():
    from helix_core.tier2.rounds import RoundBuffer, RoundItem

    now = [0.0]
    buf = RoundBuffer([0, 1, 2], buffer_size=8, timeout_s=1.0, clock=lambda: now[0])
    buf.add_batch([RoundItem("a", 0, 3)], timeout_s=20.0)  # its deadline looked far off
    buf.add_batch([RoundItem("b", 1, 3)], timeout_s=30.0)
    assert not buf.ask(2, 3) and not buf.ask(0, 4)  # batches not in the round: nothing changes
    now[0] = 0.5
    assert buf.due_in() == pytest.approx(19.5) and buf.expire() is None
    assert buf.ask(0, 3) and buf.due_in() == 0.0
    got = buf.expire()
    assert got.closed_by == "asked" and [i.key for i in got.items] == ["a", "b"] and buf.due_in() is None
    buf.add_batch([RoundItem("c", 0, 4)], timeout_s=0.2)  # the next round starts unasked
    buf.add_batch([RoundItem("d", 1, 4)], timeout_s=9.0)
    assert buf.ask(1, 4)
    buf.drop(1, 4)  # the asking rank left: the rest keeps its own limit, and times out as usual
    assert buf.due_in() == pytest.approx(0.2)
    now[0] = 1.0
    assert buf.expire().closed_by == "timeout"
