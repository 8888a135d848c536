"""Security: tokens on every RPC, no pickle from unauthenticated peers, malformed and oversized
requests refused with a status while the cluster keeps serving."""

import dataclasses

import grpc
import pytest
from dataplane import CFG, assert_same_batches, torch_batches

import helix_core as hx
from helix_core.security.auth import call_metadata
from helix_core.testing.datasets import IndexDataset
from helix_core.wire.proto import helix_pb2 as pb
from helix_core.wire.proto import helix_pb2_grpc as pbg

TOKEN = "s3cret-token-for-tests"


@pytest.fixture(scope="module")
def secured():
    with hx.LocalCluster(local_servers=1, workers_per_server=1, token=TOKEN, config=CFG) as c:
        yield c


def _raw(address, method, payload: bytes, token=None, timeout=5):
    with grpc.insecure_channel(address) as ch:
        call = ch.unary_unary(method, request_serializer=lambda b: b, response_deserializer=lambda b: b)
        return call(payload, timeout=timeout, metadata=call_metadata(token))


def test_wrong_or_missing_token_is_refused_and_cluster_keeps_serving(secured, tmp_path, monkeypatch):
    ds = IndexDataset(6)
    with pytest.raises(hx.ClusterError, match="refused"):
        hx.DistributedDataLoader(
            ds, batch_size=2, rank=0, world_size=1, coordinator=secured.address, token="wrong", config=CFG
        )
    monkeypatch.delenv("HELIX_TOKEN", raising=False)
    monkeypatch.setenv("HELIX_RUNTIME_DIR", str(tmp_path))  # no token file for the address: none to find
    with pytest.raises(hx.ClusterError, match="refused.*none was passed.*private Helix folder"):
        hx.DistributedDataLoader(ds, batch_size=2, rank=0, world_size=1, coordinator=secured.address, config=CFG)
    for addr in (secured.address, secured.servers[0].address):
        with pytest.raises(grpc.RpcError) as err:
            _raw(
                addr,
                "/helix.v1.Coordinator/Telemetry" if addr == secured.address else "/helix.v1.DataServer/Health",
                b"",
            )
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with hx.DistributedDataLoader(
        ds, batch_size=2, rank=0, world_size=1, coordinator=secured.address, token=TOKEN, config=CFG
    ) as ld:
        assert_same_batches(list(ld), torch_batches(ds, 2, 0, 1))


def test_garbage_and_oversized_requests_get_a_status(secured):
    for method in ("/helix.v1.Coordinator/Route", "/helix.v1.Coordinator/RegisterServer"):
        with pytest.raises(grpc.RpcError) as err:
            _raw(secured.address, method, b"\xff\xfe garbage \x00\x01", token=TOKEN)
        assert err.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNKNOWN)
    with pytest.raises(grpc.RpcError) as err:
        _raw(
            secured.servers[0].address,
            "/helix.v1.DataServer/Configure",
            b"\x00" * (CFG.max_message_bytes + 1024),
            token=TOKEN,
            timeout=20,
        )
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    ch = grpc.insecure_channel(secured.servers[0].address)
    stub = pbg.DataServerStub(ch)
    md = call_metadata(TOKEN)
    with pytest.raises(grpc.RpcError) as err:
        stub.Configure(pb.ConfigureRequest(spec_id="x", payload=b"{not json", format="json"), timeout=5, metadata=md)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as err:
        stub.Execute(
            pb.ExecuteRequest(task_id=1, spec_id="never-configured", indices=[0], on_error="raise"),
            timeout=5,
            metadata=md,
        )
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert stub.Health(pb.HealthRequest(), timeout=5, metadata=md).serving  # still serving
    ch.close()


def test_pickled_specs_travel_only_where_the_cluster_takes_pickle(secured, kmix):
    class ScriptDataset(torch_dataset()):  # defined in a "training script": no helix_spec, not importable
        def __len__(self):
            return 4

        def __getitem__(self, i):
            import torch

            return {"v": torch.full((2,), i)}

    json_only = dataclasses.replace(CFG, allow_pickle=False)
    with hx.LocalCluster(local_servers=1, workers_per_server=1, config=json_only) as cluster:
        with pytest.raises(ValueError, match="ScriptDataset.*cloudpickle.*allow_pickle=False"):
            hx.DistributedDataLoader(
                ScriptDataset(), batch_size=2, rank=0, world_size=1, coordinator=cluster.address, config=CFG
            )
        ch = grpc.insecure_channel(cluster.servers[0].address)
        with pytest.raises(grpc.RpcError) as err:  # a raw pickle, with the right token, aimed at that server
            pbg.DataServerStub(ch).Configure(
                pb.ConfigureRequest(spec_id="p", payload=b"\x80\x04N.", format="cloudpickle"),
                timeout=5,
                metadata=call_metadata(cluster.token),
            )
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "allow_pickle=False" in err.value.details()
        ch.close()
        with hx.DistributedDataLoader(
            hx.VideoClipDataset(kmix / "manifest.jsonl", num_frames=2, size=32),
            batch_size=2,
            rank=0,
            world_size=1,
            coordinator=cluster.address,
            config=CFG,
        ) as ld:  # JSON specs travel everywhere
            assert len(list(ld)) == 3
    with pytest.raises(
        ValueError, match="ScriptDataset.*cloudpickle"
    ):  # a client that takes none, on a cluster that does
        hx.DistributedDataLoader(
            ScriptDataset(), batch_size=2, rank=0, world_size=1, coordinator=secured.address, config=json_only
        )
    with hx.DistributedDataLoader(
        ScriptDataset(), batch_size=2, rank=0, world_size=1, coordinator=secured.address, config=CFG
    ) as ld:  # no token passed: this user's file of the address has it
        assert [b["v"][:, 0].tolist() for b in ld] == [[0, 1], [2, 3]]


def torch_dataset():
    import torch

    return torch.utils.data.Dataset


def test_binding_beyond_loopback_needs_a_token():
    from helix_core.wire.rpc import create_server

    with pytest.raises(ValueError, match="needs a token"):
        create_server("0.0.0.0", 0, None, CFG)
    with pytest.raises(ValueError, match="needs TLS"):
        create_server("0.0.0.0", 0, TOKEN, CFG)
    server, port = create_server("0.0.0.0", 0, TOKEN, CFG, insecure=True)
    assert port > 0
    server.stop(0)


def test_the_job_store_rendezvous_never_trusts_a_stale_or_foreign_entry():
    import json

    import torch.distributed as dist

    from helix_core.launch.rendezvous import JobRendezvous

    store = dist.HashStore()
    this = JobRendezvous(store, "run-7", "1")  # restart 1 of run-7
    earlier, other = JobRendezvous(store, "run-7", "0"), JobRendezvous(store, "run-8", "1")
    earlier.publish("coordinator", {"address": "10.0.0.1:1", "token": "old"})  # the attempt before the restart
    other.publish("coordinator", {"address": "10.0.0.2:1", "token": "theirs"})
    with pytest.raises(hx.ClusterError, match="within 0 s"):
        this.wait("coordinator", 0.2)  # neither is this attempt's entry
    store.set(this.prefix + "coordinator", json.dumps({"run_id": "run-8", "attempt": "1", "address": "x"}))
    with pytest.raises(hx.ClusterError, match="another run or attempt"):
        this.wait("coordinator", 1)  # planted under this job's key, but not this job's
    this.publish("coordinator", {"address": "10.0.0.3:1", "token": "mine"})
    assert this.wait("coordinator", 1)["token"] == "mine"


@pytest.mark.parametrize("collate", ["subprocess:call", "os:system", "builtins:eval", "torch.utils.data:Dataset"])
def test_a_json_spec_names_only_a_dataset_class_and_a_python_collate_function(collate):
    import json

    from helix_core.data.specs import load_spec

    spec = {
        "dataset": {"target": "helix_core.testing.datasets:IndexDataset", "kwargs": {"n": 2}},
        "collate_fn": collate,
    }
    with pytest.raises(TypeError, match="collate_fn"):
        load_spec(json.dumps(spec).encode(), "json", allow_pickle=False)
    spec["collate_fn"], spec["dataset"]["target"] = "helix_core.testing.datasets:pair_collate", "subprocess:Popen"
    with pytest.raises(TypeError, match="not a torch Dataset"):
        load_spec(json.dumps(spec).encode(), "json", allow_pickle=False)
    spec["dataset"]["target"] = "helix_core.testing.datasets:IndexDataset"
    ds, fn, _ = load_spec(json.dumps(spec).encode(), "json", allow_pickle=False)
    assert len(ds) == 2 and fn([ds[0], ds[1]])[1].tolist() == [0, 1]
