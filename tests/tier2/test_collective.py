"""Tier-2 redistribution by collective: real processes in a gloo group exchange a round of decoded
samples with one all_to_all (bit-identical, in Helix's JSON-plus-tensors form, never pickle); a
member that dies makes the others' round fail within its timeout instead of hanging."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import torch

from helix_core.tier2.collective import pack, unpack

APPS = Path(__file__).resolve().parents[1] / "apps"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _members(tmp_path, world: int, **extra) -> list[tuple[subprocess.Popen, Path]]:
    port = _free_port()
    started = []
    for rank in range(world):
        out = tmp_path / f"member{rank}.json"
        args = dict(rank=rank, world=world, port=port, samples=2 * world, out=str(out), **extra)
        started.append((subprocess.Popen([sys.executable, str(APPS / "exchange_member.py"), json.dumps(args)]), out))
    return started


def test_pack_and_unpack_keep_every_leaf():
    samples = [
        {
            "video": torch.arange(4096, dtype=torch.uint8).reshape(4, 32, 32),
            "index": 1,
            "caption": "café",
            "small": torch.tensor([1.5, -2.0]),
            "nested": ({"ids": torch.arange(3)}, None),
        },
        {},
    ]
    out = unpack(pack(samples))
    assert torch.equal(out[0]["video"], samples[0]["video"]) and torch.equal(out[0]["small"], samples[0]["small"])
    assert out[0]["caption"] == "café" and out[0]["index"] == 1 and out[1] == {}
    assert torch.equal(out[0]["nested"][0]["ids"], torch.arange(3)) and out[0]["nested"][1] is None
    assert unpack(pack([])) == []


def test_three_processes_exchange_a_round_bit_identical(tmp_path):
    started = _members(tmp_path, 3)
    results = []
    for proc, out in started:
        assert proc.wait(timeout=120) == 0
        results.append(json.loads(out.read_text()))
    for rank, res in enumerate(results):
        assert [g["rank"] for g in res["gathered"]] == [0, 1, 2]
        # rank r receives sample k of every source with k % 3 == r, from itself too, each exactly once
        assert sorted((g["src"], g["k"]) for g in res["got"]) == [
            (src, k) for src in range(3) for k in range(6) if k % 3 == rank
        ]
        assert all(g["equal"] for g in res["got"])


def test_a_member_that_dies_mid_round_fails_the_others_round_within_its_timeout(tmp_path):
    started = _members(tmp_path, 3, die=2, timeout_s=5)
    codes = [proc.wait(timeout=120) for proc, _ in started]
    assert codes == [0, 0, 3]
    for _, out in started[:2]:
        res = json.loads(out.read_text())
        assert "redistribution round failed" in res["error"] and res["after_s"] < 30
