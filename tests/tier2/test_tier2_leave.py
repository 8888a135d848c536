"""Who owns a batch whose Rebalance call will not be answered (the leader's ``RoundTable``, in
process: its calls on threads, as gRPC runs them): a batch in its open round leaves it, one whose
round has closed gets that round's answer, and a call that comes after its rank left joins no
round. (The rounds here move rows by a user policy, so no slab needs to exist.)"""

import threading
import time

import cloudpickle

from helix_core.memory.shm import SlabHandle
from helix_core.tier2.leader import RoundTable
from helix_core.wire.proto import helix_pb2 as pb

GROUP = "p:0,1"
RELEASE = threading.Event()


def _swap_when_released(features, args):
    RELEASE.wait(30)  # the round stays closed and running until the test lets it go
    return [1 - f["rank"] for f in features]


def _request(rank: int, step: int = 0, policy=None, timeout_s: float = 30.0) -> pb.RebalanceRequest:
    payload = cloudpickle.dumps({"sort_fn": policy, "args": None})
    return pb.RebalanceRequest(
        group=GROUP,
        group_size=2,
        rank=rank,
        step=step,
        client_id=f"c{rank}",
        host="h",
        buffer_size=8,
        timeout_s=timeout_s,
        features_json='[{"tokens": 1}, {"tokens": 2}]',
        batch_rows=[2],
        batches=[pb.BatchHandle(slab=pb.SlabHandle(segment=f"s{rank}", generation=1))],
        indices=[2 * rank, 2 * rank + 1],
        policy_id="swap" if policy else "default",
        policy=payload,
        policy_format="cloudpickle",
    )


def _leave(rank: int, step: int = 0, timeout_s: float = 10.0) -> pb.LeaveRoundRequest:
    return pb.LeaveRoundRequest(group=GROUP, step=step, rank=rank, client_id=f"c{rank}", timeout_s=timeout_s)


def _call(table, request):
    """The call on its own thread; ``(thread, box)`` where ``box`` gets its reply."""
    box = []
    t = threading.Thread(target=lambda: box.append(table.rebalance(request)), daemon=True)
    t.start()
    return t, box


def _until(what, cond, timeout_s=10.0):
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, what
        time.sleep(0.01)


def test_a_batch_that_leaves_its_open_round_is_the_ranks_own_and_the_round_goes_on_without_it():
    table = RoundTable(allow_pickle=True)
    t0, box0 = _call(table, _request(0, timeout_s=1.0))
    _until("rank 0's batch in its round", lambda: table._calls)
    answer = table.leave(_leave(0))
    t0.join(5)
    assert answer.left and box0[0].outcome == "cancelled" and not box0[0].moved_out
    t1, box1 = _call(table, _request(1, timeout_s=0.3))  # rank 1 comes: nobody to trade with
    t1.join(5)
    assert box1[0].outcome == "alone" and not box1[0].moved_in


def test_a_rank_leaving_a_round_that_has_closed_gets_the_rounds_answer_to_give_back():
    RELEASE.clear()
    table = RoundTable(allow_pickle=True)
    calls = [_call(table, _request(r, policy=_swap_when_released)) for r in range(2)]
    _until("the round closed", lambda: all(c.closed for c in table._calls.values()) and len(table._calls) == 2)
    got = []
    leaving = threading.Thread(target=lambda: got.append(table.leave(_leave(0))), daemon=True)
    leaving.start()
    time.sleep(0.2)
    assert not got, "a leave must wait for a round that closed with its batch"
    RELEASE.set()
    leaving.join(5)
    for t, _ in calls:
        t.join(5)
    answer, reply1 = got[0], calls[1][1][0]
    assert not answer.left and answer.reply.outcome == "moved"
    assert [list(t.indices) for t in answer.reply.takes] == [[2, 3]]  # what rank 0 must give back
    assert reply1.outcome == "moved" and [list(t.indices) for t in reply1.takes] == [[0, 1]]


def test_a_call_that_comes_after_its_rank_left_joins_no_round():
    table = RoundTable(allow_pickle=True)
    assert table.leave(_leave(0, step=5)).left
    t0, box0 = _call(table, _request(0, step=5))
    t0.join(5)
    assert box0 and box0[0].outcome == "cancelled"
    t1, box1 = _call(table, _request(1, step=5, timeout_s=0.3))
    t1.join(5)
    assert box1[0].outcome == "alone"


def test_a_leave_that_waits_past_its_limit_says_nobody_knows_yet():
    RELEASE.clear()
    table = RoundTable(allow_pickle=True)
    calls = [_call(table, _request(r, step=7, policy=_swap_when_released)) for r in range(2)]
    _until("the round closed", lambda: len(table._calls) == 2 and all(c.closed for c in table._calls.values()))
    answer = table.leave(_leave(1, step=7, timeout_s=0.2))
    assert not answer.left and not answer.HasField("reply")
    RELEASE.set()
    for t, _ in calls:
        t.join(5)


def test_a_rank_that_asks_for_its_held_batch_closes_its_round_at_once():
    table = RoundTable(allow_pickle=True)
    t0, box0 = _call(table, _request(0, timeout_s=60.0))  # rank 1 is not coming; the limit is far off
    _until("rank 0's batch in its round", lambda: table._calls)
    ask = pb.AskRoundRequest(group=GROUP, step=0, rank=0, client_id="c0")
    assert not table.ask(pb.AskRoundRequest(group=GROUP, step=1, rank=0, client_id="c0")).asked  # no such batch
    assert table.ask(ask).asked
    t0.join(10)
    assert not t0.is_alive() and box0[0].outcome == "alone" and box0[0].closed_by == "asked"
    assert not table.ask(ask).asked  # its round is over: nothing to close


def test_a_run_is_named_by_its_resume_point_and_under_torchrun_by_the_jobs_attempt():
    from helix_core.tier2.rank import run_name

    assert run_name(env={}) == "" and run_name("2:7", env={}) == "2:7"
    first = run_name("2:7", env={"TORCHELASTIC_RUN_ID": "j", "TORCHELASTIC_RESTART_COUNT": "0"})
    again = run_name("2:7", env={"TORCHELASTIC_RUN_ID": "j", "TORCHELASTIC_RESTART_COUNT": "1"})
    assert first == "2:7@j/0" and again == "2:7@j/1"  # two attempts resumed from one checkpoint never meet


def _default_request(rank: int, tokens: list[int], input_wait_s: float, step: int) -> pb.RebalanceRequest:
    r = _request(rank, step=step, timeout_s=5.0)
    r.features_json = "[" + ", ".join(f'{{"tokens": {t}, "bytes": 1}}' for t in tokens) + "]"
    r.seconds_per_unit, r.input_wait_s = 1e-3, input_wait_s
    r.policy_id, r.policy, r.policy_format = "default", b'{"sort_fn": null, "args": null}', "json"
    return r


def test_the_default_gate_keeps_a_skewed_round_whose_ranks_all_wait_longer_for_input_than_it_would_save():
    skew = ([1000, 900], [1, 1])  # rank 0's step is 1.9 s of GPU, rank 1's 2 ms: LPT would save 0.9 s
    table = RoundTable(allow_pickle=True)
    calls = [_call(table, _default_request(r, skew[r], wait, 0)) for r, wait in ((0, 1.5), (1, 1.0))]
    for t, _ in calls:
        t.join(10)
    replies = [box[0] for _, box in calls]
    assert [r.outcome for r in replies] == ["kept", "kept"]  # input binds: the saving would only be waited away
    assert all(r.input_wait_s == 1.0 and r.gain_s == 0.0 and not r.moved_in for r in replies)
    calls = [_call(table, _default_request(r, skew[r], wait, 1)) for r, wait in ((0, 1.5), (1, 0.0))]
    for t, _ in calls:
        t.join(10)
    replies = [box[0] for _, box in calls]  # rank 1 never waits: the gate moves (these slabs do not exist)
    assert all(r.input_wait_s == 0.0 and "slab" in r.outcome and r.outcome.startswith("error") for r in replies)


def test_a_committed_round_is_what_every_rank_learns_and_one_a_rank_was_told_it_kept_can_never_commit():
    from helix_core.tier2.fates import RoundFates

    now = [0.0]
    fates = RoundFates(capacity=3, clock=lambda: now[0])
    assert fates.commit(("g", "", 3), {0: [8, 9], 1: [10, 11]}, {0: [SlabHandle("s0", 4)]})
    assert fates.fate(("g", "", 3), 0) == ([8, 9], [SlabHandle("s0", 4)])
    assert fates.fate(("g", "", 3), 1) == ([10, 11], [])
    assert fates.fate(("g", "", 3), 2) is None  # not in that round: its batch is its own
    assert not fates.commit(("g", "", 3), {})  # a rank learned it: the leader can no longer withdraw it
    assert fates.fate(("g", "", 4), 0) is None  # asked before any commit: the rank keeps its batch...
    assert not fates.commit(("g", "", 4), {0: [1], 1: [0]})  # ...and the leader can no longer move any
    assert fates.fate(("g", "", 4), 1) is None
    assert fates.commit(("g", "", 5), {0: [1]}) and fates.commit(("g", "", 5), {})  # withdrawn, nobody asked
    assert fates.fate(("g", "", 5), 0) is None
    assert fates.commit(("g", "", 6), {0: [7]})
    assert fates.fate(("g", "", 3), 0) is None  # the oldest was forgotten (capacity 3): refused from now on
    now[0] = 60.0  # a later run of the same spec reaches the same steps: the records are an earlier run's
    assert fates.fate(("g", "", 6), 0, age_s=5.0) is None  # not served: its round began 5 s ago
    assert fates.commit(("g", "", 4), {0: [1]}, age_s=5.0)  # an earlier run's refusal does not refuse it
    assert fates.fate(("g", "", 4), 0, age_s=5.0) == ([1], [])
    now[0] = 60.0 + 601  # ten minutes on, one round later: the rounds before are forgotten
    assert fates.commit(("g", "", 7), {0: [2]}) and fates.fate(("g", "", 4), 0) is None


def test_a_moved_round_is_committed_before_any_rank_sees_it_and_a_refused_commit_keeps_every_batch():
    RELEASE.set()
    committed = []

    def commit(*a):  # no rank has an answer yet
        committed.append((*a, [c.reply for c in table._calls.values()]))
        return True

    table = RoundTable(allow_pickle=True, commit=commit)
    calls = [_call(table, _request(r, step=9, policy=_swap_when_released)) for r in range(2)]
    for t, _ in calls:
        t.join(5)
    assert [b[0].outcome for _, b in calls] == ["moved", "moved"]
    ((group, run, step, moved, release, age_s, answers),) = committed
    assert answers == [None, None]
    assert (group, run, step, moved) == (GROUP, "", 9, {0: [2, 3], 1: [0, 1]})  # each rank's samples, in order
    assert release == {0: [SlabHandle("s1", 1)], 1: [SlabHandle("s0", 1)]} and 0 <= age_s < 5  # the slab each reads
    table = RoundTable(allow_pickle=True, commit=lambda *a: False)  # a rank was already told to keep
    calls = [_call(table, _request(r, step=9, policy=_swap_when_released)) for r in range(2)]
    for t, _ in calls:
        t.join(5)
    for r, (_, box) in enumerate(calls):
        assert box[0].outcome.startswith("error: the round could not go ahead") and not box[0].moved_in
        assert [list(t.indices) for t in box[0].takes] == [[2 * r, 2 * r + 1]]  # its own batch


def test_a_commit_lost_on_the_way_is_withdrawn_unless_a_rank_already_learned_it():
    RELEASE.set()
    for learned, outcome in ((False, "error: the round could not go ahead"), (True, "moved")):
        seen = []

        def commit(group, run, step, moved, release, age_s, seen=seen, learned=learned):
            seen.append(moved)
            if moved:  # it may have landed: the reply did not come back
                raise TimeoutError("Deadline Exceeded")
            return not learned  # the withdrawal; refused once a rank learned the round

        table = RoundTable(allow_pickle=True, commit=commit)
        calls = [_call(table, _request(r, step=11, policy=_swap_when_released)) for r in range(2)]
        for t, _ in calls:
            t.join(5)
        assert [m == {} for m in seen] == [False, True]  # the commit, then its withdrawal
        assert all(box[0].outcome.startswith(outcome) for _, box in calls)
        assert all(bool(box[0].moved_in) == learned for _, box in calls)  # every rank agrees with the record


def test_a_withdrawal_that_cannot_reach_the_coordinator_is_tried_again_before_every_rank_keeps():
    RELEASE.set()
    seen = []

    def commit(group, run, step, moved, release, age_s):
        seen.append(moved)
        if moved or len(seen) < 3:  # the commit's reply is lost, then the Coordinator is out of reach once
            raise ConnectionError("UNAVAILABLE")
        return True

    table = RoundTable(allow_pickle=True, commit=commit)
    calls = [_call(table, _request(r, step=12, policy=_swap_when_released)) for r in range(2)]
    for t, _ in calls:
        t.join(10)
    assert [m == {} for m in seen] == [False, True, True]  # the commit, a failed withdrawal, the one that landed
    assert all(
        box[0].outcome.startswith("error: the round could not go ahead")
        and "withdrawn" in box[0].outcome
        and not box[0].moved_in
        for _, box in calls
    )
