"""TLS on every channel: a cluster whose Coordinator, DataServers and streams all speak TLS; clients
without the CA refused with a clear error; bad certificate files named by their flag up front."""

import re
import subprocess
import sys

import pytest
from dataplane import CFG, assert_same_batches, helix_children, torch_batches

import helix_core as hx
from helix_core.errors import ClusterError
from helix_core.security.auth import check_bind, pickle_allowed
from helix_core.security.tls import Tls, write_certificates
from helix_core.testing.datasets import IndexDataset


@pytest.fixture(scope="module")
def tls_cluster():
    with hx.LocalCluster(local_servers=1, remote_servers=1, token=True, tls=Tls.for_job(), config=CFG) as cluster:
        yield cluster


def test_a_tls_cluster_serves_and_streams_over_tls(tls_cluster):
    ds = IndexDataset(24, shape=(1024,))
    with hx.DistributedDataLoader(
        ds,
        batch_size=3,
        rank=0,
        world_size=1,
        coordinator=tls_cluster.address,
        token=tls_cluster.token,
        tls=tls_cluster.tls,
        scheduler="least-request",
        config=CFG,
    ) as loader:
        assert loader.client.pickle_allowed  # a token over TLS: cloudpickle may travel
        assert_same_batches(list(loader), torch_batches(ds, 3, 0, 1))
        assert loader.stats()["cross_ds_bytes"] > 0  # the sidecar streamed, over TLS too


def test_a_client_without_the_ca_or_a_certificate_is_refused_with_a_clear_error(tls_cluster):
    ds = IndexDataset(4)
    kw = dict(batch_size=2, rank=0, world_size=1, coordinator=tls_cluster.address, token=tls_cluster.token, config=CFG)
    with pytest.raises(ClusterError, match="if it uses TLS, set HELIX_TLS_CA"):
        hx.DistributedDataLoader(ds, **kw)  # a plain-text channel to a TLS port
    stranger = Tls.for_job()  # another job's CA and certificate: neither side's is signed by the other's CA
    with pytest.raises(ClusterError, match="signed by the CA"):
        hx.DistributedDataLoader(ds, tls=stranger, **kw)
    mine = tls_cluster.tls  # the right CA but no certificate of its own: TLS here is mutual
    with pytest.raises(ClusterError, match="every peer presents a certificate"):
        hx.DistributedDataLoader(ds, tls=Tls(mine.ca, server_name=mine.server_name), **kw)


def test_tls_files_are_checked_up_front_naming_the_flag(tmp_path):
    mine = write_certificates(str(tmp_path / "mine"), ["127.0.0.1"])
    other = write_certificates(str(tmp_path / "other"), ["127.0.0.1"])
    not_pem = tmp_path / "notes.txt"
    not_pem.write_text("hello\n")
    cases = [
        (
            {"--tls-cert": str(tmp_path / "missing.pem"), "--tls-key": mine["key"], "--tls-ca": mine["ca"]},
            "--tls-cert: cannot read",
        ),
        ({"--tls-cert": mine["cert"], "--tls-key": str(not_pem), "--tls-ca": mine["ca"]}, "--tls-key: .* is not PEM"),
        (
            {"--tls-cert": mine["cert"], "--tls-key": mine["key"], "--tls-ca": other["ca"]},
            "the certificate in --tls-cert is not signed by the CA in --tls-ca",
        ),
        (
            {"--tls-cert": mine["cert"], "--tls-key": other["key"], "--tls-ca": mine["ca"]},
            "--tls-key is not the key of the certificate in --tls-cert",
        ),
        ({"--tls-cert": mine["cert"], "--tls-key": mine["key"]}, "--tls-ca is needed"),
    ]
    before = helix_children()
    for flags, message in cases:
        argv = [sys.executable, "-m", "helix_core.launch.cli", "coordinator", "--port", "0"]
        for flag, value in flags.items():
            argv += [flag, value]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, (flags, done.stderr)
        assert re.search(message, done.stderr), (message, done.stderr)
    assert helix_children() == before  # nothing left running


def test_beyond_loopback_a_service_needs_a_token_and_tls_or_insecure():
    tls = Tls.for_job()
    check_bind("127.0.0.1", "t")  # loopback: a token, no TLS needed
    with pytest.raises(ValueError, match="needs a token"):  # no service runs without one
        check_bind("127.0.0.1", None)
    with pytest.raises(ValueError, match="needs a token"):
        check_bind("192.0.2.1", None, tls)
    with pytest.raises(ValueError, match="needs TLS .*--insecure"):
        check_bind("192.0.2.1", "t")
    check_bind("192.0.2.1", "t", tls)
    check_bind("192.0.2.1", "t", None, insecure=True)  # allowed, with a warning
    # pickles only with a token, and only where the token can't be read off the wire
    assert pickle_allowed("127.0.0.1", "t") and pickle_allowed("192.0.2.1", "t", tls)
    assert not pickle_allowed("192.0.2.1", "t") and not pickle_allowed("127.0.0.1", None, tls)
