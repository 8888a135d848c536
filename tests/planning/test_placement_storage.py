"""Eq. 1's I/O term per server: what reading a sample from storage costs where it would run
(pure: plain columns, and the Coordinator's registry with an injected clock)."""

import numpy as np
import pytest

from helix_core.config import ClusterConfig
from helix_core.coordinator.registry import Registry
from helix_core.planning.placement import Candidates, DeadlineAware, PlacementRequest

P = DeadlineAware()
MB = 1_000_000


def two(kinds=("remote", "remote"), storage_bps=(), storage_latency_s=(), queued=(0.0, 0.0), local=None):
    return Candidates(
        ("a", "b"),
        kinds,
        (1, 1),
        (0, 0),
        queued_cpu_s=queued,
        local=local,
        storage_bps=storage_bps,
        storage_latency_s=storage_latency_s,
    )


def req(io_bytes, samples=1, deadline_s=None, cpu_s=0.05, out_bytes=1000):
    return PlacementRequest(
        rank=0, task_id=1, cpu_s=cpu_s, out_bytes=out_bytes, io_bytes=io_bytes, samples=samples, deadline_s=deadline_s
    )


def test_two_servers_equal_but_for_storage_a_large_input_goes_to_the_fast_storage():
    """A sidecar beside the bucket (500 MB/s) and one behind a slow link (20 MB/s): a clip of
    40 MB costs 0.08 s to read on one and 2 s on the other — placement sees it."""
    c = two(storage_bps=(20e6, 500e6), storage_latency_s=(0.05, 0.005))
    d = P.choose(req(40 * MB), c)
    assert d.server_id == "b" and d.reason == "earliest-finish"
    t = d.finish_by_server()
    assert t["a"] - t["b"] == pytest.approx((40 * MB / 20e6 + 0.05) - (40 * MB / 500e6 + 0.005))
    # with a deadline, too: only the fast one meets it
    d = P.choose(req(40 * MB, deadline_s=0.5), c)
    assert d.server_id == "b" and d.reason == "meets-deadline"
    # and against the rank's own local server that reads slowly: it meets the deadline, but the
    # sidecar beside the bucket is ready more than half the deadline sooner
    local = two(("local", "remote"), storage_bps=(20e6, 500e6), storage_latency_s=(0.05, 0.005), local=0)
    d = P.choose(req(40 * MB, deadline_s=3.0), local)
    assert d.server_id == "b" and d.reason == "remote-gain"


def test_a_batch_pays_each_samples_storage_latency():
    c = two(storage_bps=(100e6, 100e6), storage_latency_s=(0.01, 0.04))
    one, eight = P.finish_times(req(8 * MB, samples=1), c), P.finish_times(req(8 * MB, samples=8), c)
    assert eight - one == pytest.approx([7 * 0.01, 7 * 0.04])
    unknown = P.finish_times(req(8 * MB, samples=0), c)  # an older client: counted as one sample
    assert np.array_equal(unknown, one)


def test_without_a_measurement_the_costs_are_exactly_as_before():
    """No column, zero columns, or a request of unknown input: ``io_bytes / io_bps`` for every
    server, bit for bit what the formula gave before storage was measured."""
    request = req(40 * MB, samples=4, deadline_s=0.3)
    before = two()  # no storage columns at all
    want = (np.zeros(2) + request.cpu_s) * 1.0
    want += P.network_terms(before, np.array([True, True]))[0] * request.out_bytes
    want += P.network_terms(before, np.array([True, True]))[1] + request.io_bytes / P.io_bps
    for c in (before, two(storage_bps=(0.0, 0.0), storage_latency_s=(0.0, 0.0))):
        assert np.array_equal(P.finish_times(request, c), want)
        assert P.choose(request, c).scores_by_server() == P.choose(request, before).scores_by_server()
    # one server measured: the other keeps the default exactly
    mixed = P.finish_times(request, two(storage_bps=(0.0, 50e6), storage_latency_s=(0.0, 0.02)))
    assert mixed[0] == want[0] and mixed[1] == pytest.approx(want[1] - request.io_bytes / P.io_bps + 0.8 + 4 * 0.02)
    # a request whose input is unknown reads nothing anywhere
    measured = two(storage_bps=(1e6, 1e9), storage_latency_s=(1.0, 0.0))
    assert np.array_equal(P.finish_times(req(0), measured), P.finish_times(req(0), before))


def test_candidates_from_rows_carry_the_storage_columns():
    c = Candidates.from_rows(
        [
            {"server_id": "a", "kind": "remote", "storage_bps": 20e6, "storage_latency_s": 0.05},
            {"server_id": "b", "kind": "remote", "storage_bps": 500e6},
        ]
    )
    assert c.storage_bps == (20e6, 500e6) and c.storage_latency_s == (0.05, 0.0)
    assert P.choose(req(40 * MB), c).server_id == "b"
    with pytest.raises(ValueError, match="lengths"):
        two(storage_bps=(1.0,))


def test_the_coordinator_prices_each_servers_storage_from_its_heartbeats():
    """Two sidecars and a rank's local server, equal in everything: once the heartbeats say one
    sidecar reads storage 25x faster, a large clip goes there; before any measurement, placement is
    what it was (the rank's own server)."""
    now = [0.0]
    reg = Registry(ClusterConfig(), clock=lambda: now[0])
    own = reg.register_server("h:1", "local", 0, "h", 1)
    slow = reg.register_server("h:2", "remote", 0, "h2", 1)
    fast = reg.register_server("h:3", "remote", 0, "h3", 1)
    cost = {"cpu_s": 0.05, "io_bytes": 40 * MB, "out_bytes": 1000, "tokens": 1, "samples": 1, "deadline_s": 3.0}
    chosen, *_ = reg.route(0, 1, cost, set(), host="h")
    assert chosen.server_id == own.server_id
    reg.complete([1])
    for st, bps, lat in ((own, 20e6, 0.05), (slow, 20e6, 0.05), (fast, 500e6, 0.005)):
        assert reg.heartbeat(st.server_id, storage_bandwidth_bps=bps, storage_latency_s=lat, queued_cpu_s=0.0)
    chosen, _, decision, _ = reg.route(0, 2, cost, set(), host="h")
    assert chosen.server_id == fast.server_id and decision.reason == "remote-gain"
    servers = {s["server_id"]: s for s in reg.telemetry()["servers"]}
    assert servers[fast.server_id]["storage_bandwidth_bps"] == 500e6
