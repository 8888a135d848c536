"""Pure control-plane logic: placement policy and the Coordinator's registry (injected clock)."""

import pytest

from helix_core.config import ClusterConfig
from helix_core.coordinator.registry import Registry
from helix_core.planning.placement import Candidates, LeastRequest, PlacementRequest, make_scheduler


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_least_request_prefers_fewest_outstanding_per_worker_then_local():
    p = LeastRequest()
    req = PlacementRequest(rank=0, task_id=1)
    c = Candidates.from_rows(
        [
            {"server_id": "a", "kind": "local", "workers": 2, "outstanding": 4},
            {"server_id": "b", "kind": "local", "workers": 1, "outstanding": 1},
            {"server_id": "r", "kind": "remote", "workers": 4, "outstanding": 4},
        ],
        local="a",
    )
    d = p.choose(req, c)
    assert d.server_id == "b" and d.reason == "least-request" and d.scores_by_server()["a"] == 2.0
    tie = Candidates(("x", "y", "z"), ("remote", "local", "remote"), (1, 1, 1), (0, 0, 0), local=1)
    assert p.choose(req, tie).server_id == "y" and p.choose(req, tie).reason == "local-least-request"
    no_local = Candidates(("x", "y"), ("remote", "remote"), (1, 1), (1, 0))
    assert p.choose(req, no_local).server_id == "y"
    first = Candidates(("x", "y"), ("remote", "remote"), (1, 1), (0, 0))
    assert p.choose(req, first).server_id == "x"  # equal scores: the lowest position
    with pytest.raises(ValueError, match="no live DataServer"):
        p.choose(req, Candidates((), (), (), ()))
    with pytest.raises(ValueError, match="different lengths"):
        Candidates(("x",), ("remote",), (1, 1), (0,))
    with pytest.raises(ValueError, match="least-request"):
        make_scheduler("deadline-ish")


def _registry():
    clock = Clock()
    reg = Registry(ClusterConfig.for_tests(), scheduler="least-request", clock=clock)
    servers = [reg.register_server(f"127.0.0.1:{5000 + i}", "local", i, "h", 1) for i in range(3)]
    remote = reg.register_server("127.0.0.1:6000", "remote", -1, "h", 2)
    return reg, clock, servers, remote


def test_delivery_server_is_rank_mod_locals_with_takeover():
    reg, clock, (s0, s1, s2), remote = _registry()
    assert [reg.delivery_server(r, set(), "h").server_id for r in range(5)] == [
        s0.server_id,
        s1.server_id,
        s2.server_id,
        s0.server_id,
        s1.server_id,
    ]
    assert [s.server_id for s in reg.ordered()] == [s0.server_id, s1.server_id, s2.server_id, remote.server_id]
    assert reg.delivery_server(1, {s1.server_id}, "h").server_id == s2.server_id  # the next live local takes over
    clock.t = 0.3
    for s in (s0, s2, remote):
        reg.heartbeat(s.server_id, queue_depth=0)
    clock.t = 0.7  # s1 missed heartbeats for longer than the 0.5 s timeout
    assert reg.sweep() == [s1.server_id]
    assert reg.delivery_server(1, set(), "h").server_id == s2.server_id
    chosen, delivery, decision, us = reg.route(1, 7, {}, set(), host="h")
    assert chosen.server_id != s1.server_id and delivery.server_id == s2.server_id and us > 0


def test_route_counts_outstanding_and_resubmission_moves_it():
    reg, clock, (s0, s1, s2), remote = _registry()
    picks = [reg.route(0, t, {}, set(), host="h")[0].server_id for t in range(1, 9)]
    assert picks[0] == s0.server_id  # idle cluster: stays local
    assert set(picks) == {s0.server_id, s1.server_id, s2.server_id, remote.server_id}
    assert sum(s.outstanding for s in reg.servers.values()) == 8
    first = reg.servers[picks[0]]
    before = {sid: s.outstanding for sid, s in reg.servers.items()}
    again = reg.route(0, 1, {}, {first.server_id}, host="h")[0]  # task 1 resubmitted, its first server excluded
    assert again.server_id != first.server_id
    assert first.outstanding == before[first.server_id] - 1  # the first routing is void
    assert again.outstanding == before[again.server_id] + 1
    assert sum(s.outstanding for s in reg.servers.values()) == 8
    reg.complete(range(1, 5))
    assert sum(s.outstanding for s in reg.servers.values()) == 4
    reg.complete(range(1, 9))  # completions reported twice (a Route and a flush) count once
    assert sum(s.outstanding for s in reg.servers.values()) == 0
    tele = reg.telemetry(last=3)
    assert tele["routed"] == 9 and [d["task_id"] for d in tele["decisions"]] == [7, 8, 1]
    assert 0 < tele["scheduler_overhead_us_p50"] <= tele["scheduler_overhead_us_p99"]


def _two_hosts():
    """Hosts a and b with local servers of the same local ranks (0 and 1), and one sidecar."""
    clock = Clock()
    reg = Registry(ClusterConfig.for_tests(), scheduler="least-request", clock=clock)
    a = [reg.register_server(f"10.0.0.1:{5000 + i}", "local", i, "a", 1) for i in range(2)]
    b = [reg.register_server(f"10.0.0.2:{5000 + i}", "local", i, "b", 1) for i in range(2)]
    side = reg.register_server("10.0.0.3:6000", "remote", -1, "c", 4)
    return reg, clock, a, b, side


def test_two_hosts_with_equal_local_ranks_keep_both_and_list_them_host_by_host():
    reg, clock, a, b, side = _two_hosts()
    ids = lambda servers: [s.server_id for s in servers]  # noqa: E731
    assert ids(reg.ordered()) == ids(a + b + [side])  # b's local rank 0 did not replace a's
    assert reg.hosts() == {"a": ids(a), "b": ids(b)}
    assert reg.telemetry(last=0)["hosts"] == {"a": ids(a), "b": ids(b)}
    # a rank's delivery server is its host's local server LOCAL_RANK % that host's count
    assert [reg.delivery_server(r, set(), "a", local_rank=r % 2).server_id for r in range(2)] == ids(a)
    assert [reg.delivery_server(r, set(), "b", local_rank=r - 2).server_id for r in (2, 3)] == ids(b)
    assert reg.delivery_server(9, set(), "b", local_rank=3).server_id == b[1].server_id


def test_a_rank_is_never_routed_to_another_hosts_local_server():
    reg, clock, a, b, side = _two_hosts()
    allowed = {s.server_id for s in b} | {side.server_id}
    seen = set()
    for t in range(1, 41):  # least-request spreads the load over every candidate it has
        chosen, delivery, decision, _ = reg.route(2, t, {"cpu_s": 0.1}, set(), host="b", local_rank=0)
        assert delivery.server_id == b[0].server_id
        assert set(decision.scores_by_server()) == allowed  # candidates: own host's locals + the sidecars
        seen.add(chosen.server_id)
    assert seen == allowed
    # the rank's delivery server dies: the host's other local server takes over, never host a's
    clock.t = 0.3
    for s in a + [b[1], side]:
        reg.heartbeat(s.server_id, queue_depth=0)
    clock.t = 0.7
    assert reg.sweep() == [b[0].server_id]
    assert reg.delivery_server(2, set(), "b", 0).server_id == b[1].server_id
    # host b's last local server gone: its ranks get an error naming the host; host a is untouched
    clock.t = 1.3
    for s in a + [side]:
        reg.heartbeat(s.server_id, queue_depth=0)
    assert reg.sweep() == [b[1].server_id]
    with pytest.raises(LookupError, match="on host 'b'"):
        reg.route(2, 99, {}, set(), host="b", local_rank=0)
    assert reg.route(0, 100, {}, set(), host="a", local_rank=0)[1].server_id == a[0].server_id
    with pytest.raises(LookupError, match=r"no local DataServer registered on host 'z'.*\['a', 'b'\]"):
        reg.route(0, 101, {}, set(), host="z", local_rank=0)


def test_unknown_server_heartbeat_asks_to_register_again():
    reg, *_ = _registry()
    assert reg.heartbeat("nope") is False
    with pytest.raises(ValueError, match="local, remote"):
        reg.register_server("a:1", "sidecar", 0, "h", 1)


def test_config_validation():
    with pytest.raises(ValueError, match="heartbeat_timeout_s"):
        ClusterConfig(heartbeat_interval_s=1.0, heartbeat_timeout_s=0.5)
    with pytest.raises(ValueError, match="rpc_timeout_s"):
        ClusterConfig(rpc_timeout_s=0)


def test_an_unhealthy_server_leaves_placement_and_a_silent_clients_load_is_released():
    reg, clock, (s0, s1, s2), remote = _registry()
    assert reg.heartbeat(s1.server_id, healthy=False, queue_depth=0)  # alive, but no worker it can keep
    assert reg.delivery_server(1, set(), "h").server_id == s2.server_id
    for k in range(20):
        chosen, _, _, _ = reg.route(0, 100 + k, {"cpu_s": 0.1}, set(), host="h", client_id="cA")
        assert chosen.server_id != s1.server_id
    assert reg.heartbeat(s1.server_id, healthy=True, queue_depth=0)
    assert reg.delivery_server(1, set(), "h").server_id == s1.server_id  # back once it is healthy
    cid, _ = reg.register_client(0, 1, "h", 0, client_id="cB", task_id_base=7 << 40)
    assert cid == "cB" and reg.clients["cB"]["task_id_base"] == 7 << 40  # the client's own id and base
    for k in range(3):
        reg.route(0, (7 << 40) + k, {"cpu_s": 0.5}, set(), host="h", client_id="cB")
    assert sum(s.outstanding for s in reg.servers.values()) == 23
    clock.t = reg.lease_s / 2
    reg.seen("cB")  # it renews; cA never registered, its load stays until completed
    clock.t = reg.lease_s * 1.2
    reg.sweep()
    assert "cB" in reg.clients
    clock.t = reg.lease_s * 1.6  # cB silent for longer than its lease
    reg.sweep()
    assert "cB" not in reg.clients and sum(s.outstanding for s in reg.servers.values()) == 20


def test_an_idle_servers_promised_beat_is_believed_until_work_is_routed_to_it():
    reg, clock, (s0, s1, s2), remote = _registry()  # for_tests: beats every 0.1 s, dead after 0.5 s silent
    longest = reg.longest_beat_s
    assert longest == 2 * reg.config.heartbeat_timeout_s
    reg.heartbeat(s0.server_id, next_beat_s=longest)  # idle: its next beat comes in `longest` seconds
    reg.heartbeat(s1.server_id, next_beat_s=100.0)  # a promise beyond the longest is not believed
    reg.heartbeat(s2.server_id, next_beat_s=0.1)  # busy: beats every interval
    reg.heartbeat(remote.server_id, next_beat_s=longest)
    clock.t = 0.6
    assert reg.sweep() == [s2.server_id]  # the busy one fell silent past the timeout
    clock.t = longest + 0.3
    assert reg.sweep() == []  # the idle ones are within their promise plus the timeout's slack
    clock.t = longest + 0.45
    assert sorted(reg.sweep()) == sorted([s0.server_id, s1.server_id, remote.server_id])


def test_work_routed_to_an_idle_server_makes_it_due_within_the_timeout():
    reg, clock, (s0, s1, s2), remote = _registry()
    for s in (s0, s1, s2, remote):
        reg.heartbeat(s.server_id, next_beat_s=reg.longest_beat_s)
    clock.t = 0.2
    chosen, delivery, _, _ = reg.route(0, 1, {}, set(), host="h")  # least-request: one of them gets it
    clock.t = 0.2 + reg.config.heartbeat_timeout_s + 0.01
    dead = reg.sweep()
    assert dead == [chosen.server_id]  # it was sent work and never beat: taken for dead within the timeout
    assert reg.heartbeat(chosen.server_id, next_beat_s=0.1) and reg.servers[chosen.server_id].alive  # back


def test_beats_slow_down_when_idle_and_work_wakes_them():
    from helix_core.server.heartbeats import Beats

    cfg = ClusterConfig.for_tests()
    beats = Beats(cfg)
    waits = [beats.next(changed=False) for _ in range(8)]
    assert waits[0] == 2 * cfg.heartbeat_interval_s and waits[-1] == 2 * cfg.heartbeat_timeout_s
    assert waits == sorted(waits)
    assert beats.next(changed=True) == cfg.heartbeat_interval_s  # a change: back to the interval
    beats.kick()  # busy: a kick costs nothing and wakes nobody
    assert beats.next(changed=False) == 2 * cfg.heartbeat_interval_s
    for _ in range(8):
        beats.next(changed=False)
    beats.kick()  # idle: the long wait ends at once and the next beat comes at the interval
    assert beats.sleep() and beats.next(changed=False) == cfg.heartbeat_interval_s
    beats.close()
    assert not beats.sleep()
