"""One training rank on an emulated host (tests/launch/test_hosts.py): iterate an epoch through a Helix
cluster for each placement policy asked, compare with torch's DataLoader + DistributedSampler, and
write what it saw as JSON. Usage: python hosts_rank.py '<json arguments>'"""

import json
import os
import signal
import sys
import traceback

import torch
from torch.utils.data import DataLoader, DistributedSampler

import helix_core as hx
import helix_core.testing.datasets
from helix_core.config import ClusterConfig
from helix_core.security.hostid import host_id
from helix_core.testing.datasets import IndexDataset, shift_ranks


def main(a: dict) -> dict:
    ds = IndexDataset(
        a["n"],
        shape=a.get("shape", (4,)),
        delays={i: a.get("delay_s", 0.0) for i in range(a["n"])} if a.get("delay_s") else None,
    )
    if a.get("die_rank") == a["rank"]:  # SIGKILLed once its first round that moved rows answered it
        _die_after_round()
    sampler = DistributedSampler(ds, num_replicas=a["world"], rank=a["rank"], shuffle=False)
    want = list(DataLoader(ds, batch_size=a["batch"], sampler=sampler))
    out = {"host": host_id(), "runs": {}}
    rebalance = a.get("rebalance")
    if rebalance:  # Tier 2: a policy by import path (the test's own shift of ranks)
        rebalance = dict(rebalance, sort_fn=shift_ranks)
        shifted = DistributedSampler(
            ds, num_replicas=a["world"], shuffle=False, rank=(a["rank"] - rebalance["args"]["shift"]) % a["world"]
        )
        want = list(DataLoader(ds, batch_size=a["batch"], sampler=shifted))  # the batches the policy gives it
    for scheduler in a["schedulers"]:
        run = out["runs"][scheduler] = {}
        try:
            with hx.DistributedDataLoader(
                ds,
                batch_size=a["batch"],
                rank=a["rank"],
                world_size=a["world"],
                coordinator=a["coordinator"],
                token=a["token"],
                scheduler=scheduler,
                config=ClusterConfig.for_tests(),
                rebalance=rebalance,
            ) as loader:
                got = []
                for batch in loader:
                    got.append(batch)
                    if len(got) == 1 and a.get("mark_first"):  # the test acts once this rank is mid-epoch
                        open(a["out"] + ".first", "w").close()
                run["indices"] = [b["index"].tolist() for b in got]
                run["equal"] = len(got) == len(want) and all(
                    torch.equal(g["x"], w["x"]) and torch.equal(g["index"], w["index"]) for g, w in zip(got, want)
                )
                stats = loader.stats()
                run["cross_ds_bytes"], run["resubmits"] = stats["cross_ds_bytes"], stats["resubmits"]
                run["rebalance"], run["rebalance_errors"] = dict(stats["rebalance"]), list(stats["rebalance_errors"])
                # how the Coordinator sees this client, while it still holds its lease
                run["registered_host"] = loader.client.telemetry()["clients"][loader.client.client_id]["host"]
        except Exception as e:  # noqa: BLE001 - the test reads the error
            run["error"] = f"{type(e).__name__}: {e}"
            run["trace"] = traceback.format_exc()
    return out


def _die_after_round() -> None:
    from helix_core.loader.cluster_client import ClusterClient

    rebalance = ClusterClient.rebalance

    def then_die(self, *args, **kwargs):
        reply = rebalance(self, *args, **kwargs)
        if reply is not None and reply.moved_out:  # the round's exchange is over: the rank holds its answer
            os.kill(os.getpid(), signal.SIGKILL)
        return reply

    ClusterClient.rebalance = then_die


if __name__ == "__main__":
    args = json.loads(sys.argv[1])
    os.environ["LOCAL_RANK"] = str(args["local_rank"])
    result = main(args)
    with open(args["out"], "w") as f:
        json.dump(result, f)
