"""The deploy/ templates (Kubernetes, Slurm) run the same `helix` commands as a user would: each
command in them parses with the CLI's own parser."""

import re
import shlex
from pathlib import Path

import pytest
import yaml

from helix_core.launch.cli import build_parser
from helix_core.launch.process import build_parser as service_parser

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SERVICES = ("coordinator", "dataserver")


def _parse(argv: list[str], where: str):
    try:
        if argv[0] in SERVICES:
            return service_parser().parse_args(argv)
        return build_parser().parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"{where}: `helix {' '.join(argv)}` does not parse (exit {e.code})")


_VALUES = {"PORT": "7070", "0": "head:7070", "1": "/tmp/token", "POD_IP": "10.0.0.7"}


def _substitute(text: str) -> str:
    """Shell and Kubernetes expansions replaced by sample values (numbers where flags want them)."""
    text = re.sub(r"\$\(POD_IP\)", _VALUES["POD_IP"], text)  # Kubernetes' $(VAR)
    text = re.sub(r'"?\$\((?:[^()]|\([^()]*\))*\)"?', "10.0.0.8", text)  # $(hostname -I | ...), quoted or not
    return re.sub(r"\$\{?(\w+)\}?", lambda m: _VALUES.get(m.group(1), f"/x/{m.group(1)}"), text)


def test_every_helix_command_in_the_slurm_script_parses():
    text = (DEPLOY / "slurm" / "helix-hetjob.sbatch").read_text()
    commands = [m.group(1) for m in re.finditer(r"(?:^|[\s'])helix\s+([a-z][^\n&']*)", text, re.M)]
    parsed = [_parse(shlex.split(_substitute(c)), "slurm") for c in commands]
    roles = [getattr(a, "role", None) or a.fn.__name__ for a in parsed]
    assert roles.count("dataserver") == 2 and "coordinator" in roles and "_cmd_certs" in roles, roles
    local, remote = (a for a in parsed if getattr(a, "role", None) == "dataserver")
    assert local.local_rank == 0 and remote.remote


def test_every_helix_command_in_the_kubernetes_manifest_parses():
    docs = list(yaml.safe_load_all((DEPLOY / "kubernetes" / "helix-cluster.yaml").read_text()))
    containers = [
        c
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet")
        for c in d["spec"]["template"]["spec"]["containers"]
    ]
    parsed = []
    for c in containers:
        assert c["command"] == ["helix"], c["name"]
        parsed.append(_parse([_substitute(a) for a in c["args"]], c["name"]))
    assert sorted(a.role for a in parsed) == ["coordinator", "dataserver"]
    sidecar = next(a for a in parsed if a.role == "dataserver")
    assert sidecar.remote and sidecar.tls_ca and sidecar.token_file  # beyond loopback: token and TLS
    services = {d["metadata"]["name"] for d in docs if d["kind"] == "Service"}
    assert "helix-coordinator" in services
