"""One member of a redistribution group (tests/tier2/test_collective.py): build this rank's samples,
send sample k to rank k % world, and write what arrived as JSON. Usage: python exchange_member.py '<json>'"""

import json
import os
import sys
import time

import torch

from helix_core.errors import ClusterError
from helix_core.tier2.collective import GlooGroup


def sample(rank: int, k: int) -> dict:
    g = torch.Generator().manual_seed(rank * 1000 + k)
    return {
        "video": torch.randint(0, 255, (2, 3, 16 + k, 16), generator=g, dtype=torch.uint8),
        "index": rank * 100 + k,
        "tokens": 7 * k,
        "meta": [f"r{rank}k{k}", torch.tensor([rank, k])],
    }


def main(a: dict) -> dict:
    group = GlooGroup(a["rank"], a["world"], "127.0.0.1", a["port"], timeout_s=a.get("timeout_s", 30))
    try:
        gathered = group.all_gather_json({"rank": a["rank"], "pid": os.getpid()})
        if a.get("die") == a["rank"]:
            os._exit(3)  # dies before the exchange: the others' round must fail, not hang
        outgoing = [[] for _ in range(a["world"])]
        for k in range(a["samples"]):
            outgoing[k % a["world"]].append(sample(a["rank"], k))
        t0 = time.monotonic()
        try:
            incoming = group.all_to_all(outgoing)
        except ClusterError as e:
            return {"error": str(e), "after_s": time.monotonic() - t0}
        got = []
        for src, samples in enumerate(incoming):
            for s in samples:
                k = s["index"] - src * 100
                want = sample(src, k)
                got.append(
                    {
                        "src": src,
                        "k": k,
                        "equal": torch.equal(s["video"], want["video"])
                        and s["meta"][0] == want["meta"][0]
                        and torch.equal(s["meta"][1], want["meta"][1])
                        and s["tokens"] == want["tokens"],
                    }
                )
        return {"gathered": gathered, "got": got}
    finally:
        group.close()


if __name__ == "__main__":
    args = json.loads(sys.argv[1])
    out = main(args)
    with open(args["out"], "w") as f:
        json.dump(out, f)
